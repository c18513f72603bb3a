"""An elastic TF1 job: a graph run by a tf.compat.v1.Session, a
tf.compat.v1 momentum optimizer wrapped in hvd.DistributedOptimizer, and
hvd.elastic.TensorFlowState(session=...) over every global variable (the
momentum slots included). The graph is built once, at the size the job has
then, and run at every later size. The fixed global batches of
reference.py, each rank training on its share of every step's batch,
committed after every step; its reference is the Keras job's (the same
model and momentum SGD)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import log, train_from_the_commit  # noqa: E402
from reference import FEATURES, LEARNING_RATE, MOMENTUM, make_keras_model  # noqa: E402

import tensorflow as tf  # noqa: E402

import unison.tensorflow as hvd  # noqa: E402


def main():
    hvd.init()
    weight, bias = make_keras_model().get_weights()   # the Keras job's initial weights
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("weight", initializer=weight)
        b = tf.compat.v1.get_variable("bias", initializer=bias)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM))
        train_op = optimizer.minimize(loss)
        session = tf.compat.v1.Session()
        session.run(tf.compat.v1.global_variables_initializer())
        state = hvd.elastic.TensorFlowState(session=session, step=0)

        @hvd.elastic.run
        def train(state):
            train_from_the_commit(state, hvd.rank(), hvd.size(), lambda xb, yb: session.run(train_op, {x: xb, y: yb}))

        train(state)
        if hvd.rank() == 0:
            final_w, final_b = session.run([w, b])
            log(event="final", size=hvd.size(), step=state.step,
                params={"weight": final_w.flatten().tolist(), "bias": final_b.flatten().tolist()})
        log(event="done", rank=hvd.rank(), size=hvd.size())


if __name__ == "__main__":
    main()
