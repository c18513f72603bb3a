"""Synthetic training throughput, in the manner of Horovod's
pytorch_synthetic_benchmark.py: random images, a fixed label set, and
images/s per rank and in total.

    unisonrun -np 2 python examples/torch/synthetic_benchmark.py
    unisonrun -np 2 python examples/torch/synthetic_benchmark.py --model resnet18   # needs torchvision

With no torchvision installed (there is no CPU build of it for this torch),
the default model is a small residual convolutional network defined below.
"""
import argparse
import math
import timeit

import torch
import torch.nn.functional as F

import unison.torch as hvd


class ResidualBlock(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class SmallResNet(torch.nn.Module):
    """Three stages of two residual blocks (16, 32, 64 channels), about
    0.2 M parameters in 45 tensors: enough tensors for fusion to matter."""

    def __init__(self, num_classes):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(16), torch.nn.ReLU())
        stages = []
        for i, channels in enumerate([16, 32, 64]):
            if i:
                stages.append(torch.nn.Conv2d(channels // 2, channels, 3, stride=2, padding=1))
            stages += [ResidualBlock(channels), ResidualBlock(channels)]
        self.stages = torch.nn.Sequential(*stages)
        self.head = torch.nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(name, num_classes):
    if name == "small_resnet":
        return SmallResNet(num_classes)
    try:
        import torchvision.models
    except ImportError:
        raise SystemExit("--model %s needs torchvision, which is not installed; the default "
                         "small_resnet needs nothing" % name)
    return getattr(torchvision.models, name)(num_classes=num_classes)


def main():
    parser = argparse.ArgumentParser(description="unison synthetic training benchmark")
    parser.add_argument("--model", default="small_resnet", help="small_resnet, or a torchvision model name")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--sync-batch-norm", action="store_true", help="batch statistics across ranks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.num_classes)
    if args.sync_batch_norm:
        model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    # Adasum sums rather than averages, so the learning rate is not scaled by the rank count.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log("Model: %s (%d parameter tensors)" % (args.model, len(list(model.parameters()))))
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
    hvd.shutdown()


if __name__ == "__main__":
    main()
