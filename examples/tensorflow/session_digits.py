"""The digits classifier of digits.py, written the TF1 way, as older Horovod
TensorFlow scripts are: a graph of placeholders, a tf.compat.v1 optimizer
wrapped in hvd.DistributedOptimizer, and a MonitoredTrainingSession whose
BroadcastGlobalVariablesHook sets every rank's variables to rank 0's once
the session starts.

    unisonrun -np 2 python examples/tensorflow/session_digits.py

Each rank trains on its own shard with its own random initial weights (the
hook aligns them); the global step stops the session after the same number
of steps everywhere. With --checkpoint-dir, rank 0 alone writes
checkpoints there, and a later run resumes from the newest one: rank 0
restores it and the hook hands it to the other ranks. The global step
counts steps, whose size depends on the number of ranks, so resume on as
many ranks as wrote the checkpoint.
"""
import argparse
import os

import numpy as np
import tensorflow as tf

import unison.tensorflow as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")

tf.compat.v1.disable_eager_execution()


def dense(x, outputs, name):
    with tf.compat.v1.variable_scope(name):
        weights = tf.compat.v1.get_variable("weights", [x.shape[1], outputs],
                                            initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [outputs], initializer=tf.compat.v1.zeros_initializer())
    return tf.matmul(x, weights) + bias


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", help="rank 0 saves checkpoints here, and a run resumes from them")
    args = parser.parse_args()

    hvd.init()
    tf.compat.v1.set_random_seed(hvd.rank())  # different on purpose: the hook aligns them

    digits = np.load(DIGITS)
    x_train, x_test = (digits["x_train"] / 16.0).astype("float32"), (digits["x_test"] / 16.0).astype("float32")
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    images = tf.compat.v1.placeholder(tf.float32, [None, 64], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    logits = dense(tf.nn.relu(dense(images, 128, "hidden")), 10, "output")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    # Every rank's count of right answers on its part of the test set, summed.
    correct_everywhere = hvd.allreduce(correct, op=hvd.Sum, name="correct")

    # Horovod's advice: scale the learning rate with the number of ranks.
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(args.lr * hvd.size(), 0.9))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = optimizer.minimize(loss, global_step=global_step)

    # Every rank takes the same number of steps (shards may differ by a row).
    steps_per_epoch = min(hvd.allgather_object(len(x_train))) // args.batch_size
    test_part = {images: x_test[hvd.rank()::hvd.size()], labels: y_test[hvd.rank()::hvd.size()]}
    evaluate = EvaluateAtEnd(correct_everywhere, test_part)
    hooks = [hvd.BroadcastGlobalVariablesHook(0),
             tf.compat.v1.train.StopAtStepHook(last_step=args.epochs * steps_per_epoch), evaluate]
    rng = np.random.RandomState(1234 + hvd.rank())
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=args.checkpoint_dir if hvd.rank() == 0 else None, hooks=hooks,
            save_checkpoint_steps=steps_per_epoch, save_summaries_steps=None, log_step_count_steps=None) as session:
        step = session.run(global_step)   # rank 0's, restored or 0: the hook has broadcast it
        if hvd.rank() == 0 and step:
            print("resumed at epoch %d" % (step // steps_per_epoch), flush=True)
        order, total = rng.permutation(len(x_train)), 0.0
        while not session.should_stop():
            index = order[(step % steps_per_epoch) * args.batch_size:][:args.batch_size]
            _, value = session.run([train_op, loss], feed_dict={images: x_train[index], labels: y_train[index]})
            # Counted here: global_step fetched beside train_op may be read before or after its increment.
            step += 1
            total += value
            if step % steps_per_epoch == 0:
                epoch = step // steps_per_epoch
                if hvd.rank() == 0 and (epoch % 5 == 0 or epoch == args.epochs):
                    print("epoch %d: loss %.4f on rank 0" % (epoch, total / steps_per_epoch), flush=True)
                order, total = rng.permutation(len(x_train)), 0.0
    everyones = hvd.allgather_object(evaluate.weights)
    same = all(np.array_equal(a, b) for other in everyones for a, b in zip(other, evaluate.weights))
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks; weights identical on every rank: %s"
              % (evaluate.correct / len(x_test), hvd.size(), same), flush=True)


class EvaluateAtEnd(tf.compat.v1.train.SessionRunHook):
    """Runs the test set through the trained model, and reads its weights,
    as the session ends (the variables live only as long as the session)."""

    def __init__(self, correct_everywhere, feed):
        self.correct_everywhere, self.feed = correct_everywhere, feed

    def begin(self):
        self.trainable = tf.compat.v1.trainable_variables()

    def end(self, session):
        self.correct = session.run(self.correct_everywhere, feed_dict=self.feed)
        self.weights = session.run(self.trainable)


if __name__ == "__main__":
    main()
