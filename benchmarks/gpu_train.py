"""Synthetic ResNet training throughput on a GPU.

    unisonrun -np 1 python benchmarks/gpu_train.py   (NCCL: against the same model trained with no unison at all)
    unisonrun -np 2 python benchmarks/gpu_train.py   (ranks sharing one GPU: against DDP with gloo)

A ResNet-18 (torchvision's, else a small residual net of this file's own)
on random 3x128x128 images, SGD with momentum. At one rank the ceiling is
the plain model with no communication; with ranks sharing the one GPU,
NCCL refuses them, so unison stages through host memory, and DDP over
gloo (which also copies through the host) is the alternative. Both train
in alternating blocks in the same processes; images/s are summed over
ranks, medians of the blocks.
"""
import argparse
import statistics
import time

import torch

import unison.torch as hvd
from gpu_allreduce import start_gpu_job
from timing import agree

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def make_model():
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=100)
    except ImportError:
        layers = [torch.nn.Conv2d(3, 64, 7, 2, 3), torch.nn.BatchNorm2d(64), torch.nn.ReLU()]
        for _ in range(4):
            layers += [torch.nn.Conv2d(64, 64, 3, 1, 1), torch.nn.BatchNorm2d(64), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 100))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    device, alone = start_gpu_job()
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, 128, 128, device=device)
    labels = torch.randint(0, 100, (args.batch,), device=device)

    ours_model = make_model().to(device)
    hvd.broadcast_parameters(ours_model.state_dict(), root_rank=0)
    ours_opt = hvd.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=ours_model.named_parameters())
    theirs_model = make_model().to(device)
    if alone:
        theirs_train = theirs_model
    else:
        theirs_train = torch.nn.parallel.DistributedDataParallel(theirs_model)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.01, momentum=0.9)

    def step(model, optimizer):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    def block(model, optimizer):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(model, optimizer)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):
        step(ours_model, ours_opt)
        step(theirs_train, theirs_opt)
    samples = [[], []]
    for _ in range(args.blocks):
        hvd.barrier()
        samples[0].append(agree(block(ours_model, ours_opt)))
        hvd.barrier()
        samples[1].append(agree(block(theirs_train, theirs_opt)))
    images_per_block = args.batch * args.steps * hvd.size()
    ours, theirs = images_per_block / statistics.median(samples[0]), images_per_block / statistics.median(samples[1])
    if hvd.rank() == 0:
        other = "the model alone (no unison)" if alone else "DDP (gloo)"
        print("ResNet-18, batch %d per rank, %d rank(s) on %s: unison DistributedOptimizer %.0f images/s, %s %.0f "
              "images/s: %.2fx" % (args.batch, hvd.size(), torch.cuda.get_device_name(0), ours, other, theirs,
                                   ours / theirs))
    hvd.shutdown()


if __name__ == "__main__":
    main()
