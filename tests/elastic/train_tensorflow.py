"""An elastic TensorFlow job with a custom loop, as Horovod's TF2 elastic
example has it: TensorFlowKerasState over a model and its optimizer, and a
tf.function step through DistributedGradientTape (compiled by XLA with
TRAIN_JIT_COMPILE=1), traced once, at the size the job has then, and run
at every later size. The fixed global batches of reference.py, each rank
training on its share of every step's batch, committed after every step."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import log_end_of_keras_job, train_from_the_commit  # noqa: E402
from reference import FEATURES, make_keras_model  # noqa: E402

import tensorflow as tf  # noqa: E402

import unison.tensorflow as hvd  # noqa: E402


def main():
    hvd.init()
    model = make_keras_model()
    optimizer = model.optimizer
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)

    # One trace for every batch shape, so that the step traced in a job of
    # one is the step the grown job runs.
    # TRAIN_JIT_COMPILE=1: the step compiled by XLA, its allreduce lowered into it.
    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32), tf.TensorSpec([None, 1], tf.float32)],
                 jit_compile=os.environ.get("TRAIN_JIT_COMPILE") == "1")
    def training_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        train_from_the_commit(state, hvd.rank(), hvd.size(), lambda x, y: training_step(tf.constant(x), tf.constant(y)))

    train(state)
    log_end_of_keras_job(model, state.step, hvd.rank(), hvd.size())


if __name__ == "__main__":
    main()
