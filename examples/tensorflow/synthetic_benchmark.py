"""Synthetic training throughput for TensorFlow 2, in the manner of
Horovod's tensorflow2_synthetic_benchmark.py: random images, random
labels, a DistributedGradientTape inside a tf.function, and images/s per
rank and in total.

    unisonrun -np 2 python examples/tensorflow/synthetic_benchmark.py
    unisonrun -np 2 python examples/tensorflow/synthetic_benchmark.py --model ResNet50 --image-size 224

The default model is a small residual network defined below, sized for a
CPU; `--model` takes the name of any keras.applications model instead
(built with random weights, so nothing is downloaded).
"""
import argparse
import math
import timeit

import keras
import numpy as np
import tensorflow as tf

import unison.tensorflow as hvd


def residual_block(x, channels):
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(y)
    y = keras.layers.BatchNormalization()(y)
    return keras.layers.ReLU()(keras.layers.Add()([x, y]))


def small_resnet(image_size, num_classes):
    """Three stages of two residual blocks (16, 32, 64 channels), about
    0.2 M parameters in some 40 variables: enough tensors for fusion to
    matter. The same shape as examples/torch/synthetic_benchmark.py's."""
    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for i, channels in enumerate([16, 32, 64]):
        if i:
            x = keras.layers.Conv2D(channels, 3, strides=2, padding="same")(x)
        x = residual_block(residual_block(x, channels), channels)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def build_model(name, image_size, num_classes):
    if name == "small_resnet":
        return small_resnet(image_size, num_classes)
    application = getattr(keras.applications, name, None)
    if application is None:
        raise SystemExit("--model %s: keras.applications has no such model (try ResNet50, MobileNetV2, "
                         "or the default small_resnet)" % name)
    return application(weights=None, input_shape=(image_size, image_size, 3), classes=num_classes)


def main():
    parser = argparse.ArgumentParser(description="unison synthetic training benchmark (TensorFlow 2)")
    parser.add_argument("--model", default="small_resnet", help="small_resnet, or a keras.applications model")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    parser.add_argument("--eager", action="store_true", help="run the step eagerly, not as a tf.function")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    args = parser.parse_args()

    # Before any op runs: TensorFlow fixes its thread pools at the first one.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()

    model = build_model(args.model, args.image_size, args.num_classes)
    optimizer = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    # The optimizer's slots exist before the broadcast, so rank 0's
    # weights and slots reach every rank before the first step.
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    rng = np.random.RandomState(hvd.rank())
    images = tf.constant(rng.uniform(size=(args.batch_size, args.image_size, args.image_size, 3)).astype("float32"))
    labels = tf.constant(rng.randint(0, args.num_classes, size=args.batch_size))

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if not args.eager:
        step = tf.function(step)

    def benchmark_step():
        step().numpy()  # waits for the step, collectives included

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log("Model: %s (%d trainable variables)" % (args.model, len(model.trainable_variables)))
    log("Batch size: %d per rank" % args.batch_size)
    log("Number of ranks: %d" % hvd.size())
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log("Iter #%d: %.1f img/sec per rank" % (i, rate))
        rates.append(rate)
    mean = sum(rates) / len(rates)
    spread = 1.96 * math.sqrt(sum((r - mean) ** 2 for r in rates) / max(len(rates) - 1, 1))
    log("Img/sec per rank: %.1f +-%.1f" % (mean, spread))
    log("Total img/sec on %d rank(s): %.1f +-%.1f" % (hvd.size(), hvd.size() * mean, hvd.size() * spread))
    # Every rank must end with rank 0's weights: a cheap check that the
    # gradients really were averaged, which a throughput figure cannot show.
    first = model.trainable_variables[0]
    same = hvd.allreduce(first, op=hvd.Max, name="check.max") - hvd.allreduce(first, op=hvd.Min, name="check.min")
    log("weights identical on every rank: %s" % bool(tf.reduce_all(same == 0)))


if __name__ == "__main__":
    main()
