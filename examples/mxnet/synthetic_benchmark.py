"""Synthetic training throughput for MXNet Gluon, in the manner of
Horovod's synthetic benchmarks: random images, random labels, a
DistributedTrainer, and images/s per rank and in total.

    unisonrun -np 2 python examples/mxnet/synthetic_benchmark.py
    unisonrun -np 2 python examples/mxnet/synthetic_benchmark.py --model resnet50_v1 --image-size 224

The default model is a small residual network defined below, sized for a
CPU; `--model` takes the name of any Gluon model-zoo network instead
(built with random weights, so nothing is downloaded).
"""
import argparse
import math
import timeit

import mxnet as mx
from mxnet import autograd, gluon

import unison.mxnet as hvd


class ResidualBlock(gluon.nn.HybridBlock):
    def __init__(self, channels, **kwargs):
        super().__init__(**kwargs)
        self.body = gluon.nn.HybridSequential()
        self.body.add(gluon.nn.Conv2D(channels, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                      gluon.nn.Activation("relu"),
                      gluon.nn.Conv2D(channels, 3, padding=1, use_bias=False), gluon.nn.BatchNorm())

    def hybrid_forward(self, F, x):
        return F.relu(x + self.body(x))


def small_resnet(num_classes):
    """Three stages of two residual blocks (16, 32, 64 channels), the same
    shape as examples/torch/synthetic_benchmark.py's."""
    model = gluon.nn.HybridSequential()
    model.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
    for i, channels in enumerate([16, 32, 64]):
        if i:
            model.add(gluon.nn.Conv2D(channels, 3, strides=2, padding=1))
        model.add(ResidualBlock(channels), ResidualBlock(channels))
    model.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(num_classes))
    return model


def build_model(name, num_classes):
    if name == "small_resnet":
        return small_resnet(num_classes)
    try:
        return gluon.model_zoo.vision.get_model(name, classes=num_classes)
    except ValueError as error:
        raise SystemExit("--model %s: %s" % (name, error))


def main():
    parser = argparse.ArgumentParser(description="unison synthetic training benchmark (MXNet Gluon)")
    parser.add_argument("--model", default="small_resnet", help="small_resnet, or a Gluon model-zoo name")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    args = parser.parse_args()

    hvd.init()
    mx.random.seed(hvd.rank())  # different on purpose: the broadcast aligns them
    model = build_model(args.model, args.num_classes)
    model.initialize(mx.init.Xavier())
    model.hybridize()
    images = mx.nd.random.uniform(shape=(args.batch_size, 3, args.image_size, args.image_size))
    labels = mx.nd.random.randint(0, args.num_classes, shape=(args.batch_size,)).astype("float32")
    model(images)  # Gluon sizes its layers at the first forward; the broadcast needs them sized
    params = model.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.01 * hvd.size(), "momentum": 0.9},
                                     compression=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def benchmark_step():
        with autograd.record():
            loss = loss_fn(model(images), labels)
        loss.backward()
        trainer.step(args.batch_size)
        loss.wait_to_read()  # MXNet runs ahead of Python: wait for the step, collectives included

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log("Model: %s (%d parameter arrays)" % (args.model, len(params.keys())))
    log("Batch size: %d per rank" % args.batch_size)
    log("Number of ranks: %d" % hvd.size())
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        mx.nd.waitall()
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
    first = next(p for p in params.values() if p.grad_req != "null").data()
    spread = hvd.allreduce(first, op=hvd.Max, name="check.max") - hvd.allreduce(first, op=hvd.Min, name="check.min")
    log("weights identical on every rank: %s" % bool((spread == 0).min().asscalar()))


if __name__ == "__main__":
    main()
