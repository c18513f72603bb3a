"""Throughput of the Keras digits example (examples/keras/digits.py) at 2
ranks with unison, against tf.distribute.MultiWorkerMirroredStrategy with 2
workers on this machine, and against one process on the whole batch; all
three in one run, one after another, with the ratios.

    python benchmarks/keras_digits.py [--epochs 30] [--batch-size 32]

Every variant trains the same model (64-128-10, SGD with momentum) on the
same global batch per step (batch-size per worker), and counts training
samples per second of the whole job over the epochs after the first (the
first traces the step). The MultiWorkerMirroredStrategy workers talk over
gRPC on localhost ports, with its own collectives (ring, on CPU).
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "keras", "digits.py")


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def rate_of(output):
    found = re.findall(r"samples/s (\d+)", output)
    if not found:
        raise RuntimeError("no samples/s in:\n" + output[-3000:])
    return float(found[-1])


def mwms_worker(args):
    """One MultiWorkerMirroredStrategy worker (TF_CONFIG set by the parent)."""
    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    digits = np.load(os.path.join(os.path.dirname(HERE), "examples", "data", "digits.npz"))  # the examples' training rows
    x_train, y_train = (digits["x_train"] / 16.0).astype("float32"), digits["y_train"]
    global_batch = args.batch_size * workers
    rows = len(x_train) // global_batch * global_batch
    dataset = tf.data.Dataset.from_tensor_slices((x_train[:rows], y_train[:rows])).batch(global_batch)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05 * workers, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seconds = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:
                seconds.append(time.perf_counter() - self.started)
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[Clock()])
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if task == 0:
        print("samples/s %.0f" % (rows * (args.epochs - 1) / sum(seconds)), flush=True)


def run_mwms(args):
    ports = [free_port(), free_port()]
    procs = []
    for index in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps({
            "cluster": {"worker": ["localhost:%d" % p for p in ports]}, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--mwms-worker", "--epochs", str(args.epochs),
                                       "--batch-size", str(args.batch_size)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("MultiWorkerMirroredStrategy failed:\n" + outputs[0][-3000:] + outputs[1][-3000:])
    return rate_of(outputs[0])


def run(command):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=900)
    output = out.stdout.decode(errors="replace")
    if out.returncode:
        raise RuntimeError(" ".join(command) + " failed:\n" + output[-3000:])
    return rate_of(output)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--mwms-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mwms_worker:
        return mwms_worker(args)
    common = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--samples-per-second"]
    unison_rate = run([sys.executable, "-m", "unison.run", "-np", "2", sys.executable, EXAMPLE] + common)
    try:
        mwms_rate = run_mwms(args)
    except RuntimeError as e:
        # Keras 3's fit() does not take MultiWorkerMirroredStrategy's
        # per-replica batches on TensorFlow 2.21; say so, and go on.
        errors = [line for line in str(e).splitlines() if "Error" in line]
        print("MultiWorkerMirroredStrategy did not run: %s" % (errors[-1] if errors else str(e)[-300:]))
        mwms_rate = None
    single_rate = run([sys.executable, EXAMPLE, "--one-process", "--ranks", "2"] + common)
    print("Keras digits, batch %d per worker, %d epochs: training samples/s of the whole job"
          % (args.batch_size, args.epochs))
    print("  unison, 2 ranks:                        %8.0f" % unison_rate)
    if mwms_rate:
        print("  MultiWorkerMirroredStrategy, 2 workers: %8.0f   unison / MWMS: %.2fx"
              % (mwms_rate, unison_rate / mwms_rate))
    print("  one process, batch %3d:                 %8.0f   unison / one process: %.2fx"
          % (2 * args.batch_size, single_rate, unison_rate / single_rate))


if __name__ == "__main__":
    main()
