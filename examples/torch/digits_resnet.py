"""Horovod's ImageNet recipe (learning-rate warmup, gradient accumulation,
checkpoints that a later run resumes from) applied to a small residual
network on UCI's handwritten digits (examples/data/), with unison.torch.

    unisonrun -np 2 python examples/torch/digits_resnet.py --epochs 6 --checkpoint-dir ckpt
    unisonrun -np 3 python examples/torch/digits_resnet.py --epochs 10 --checkpoint-dir ckpt

The second run resumes from the first one's last checkpoint, here on a
different number of ranks. What the recipe does:

- rank 0 alone looks for checkpoints and broadcasts the epoch to resume
  from; it alone loads the checkpoint, and broadcast_parameters and
  broadcast_optimizer_state hand the weights and the optimizer's state
  to the other ranks;
- a DistributedSampler gives each rank its shard, reshuffled each epoch;
- each rank's batch is split into --batches-per-allreduce parts whose
  gradients add up locally (backward_passes_per_step) before one
  allreduce;
- the learning rate grows over --warmup-epochs from the one-rank rate to
  that rate times the number of ranks and parts (the large-batch scaling
  rule), then drops tenfold after each of --decay-epochs;
- losses and accuracies are averaged over the ranks with allreduce;
- only rank 0 prints and writes checkpoints.
"""
import argparse
import math
import multiprocessing
import os

import numpy as np
import torch

import unison.torch as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="rows a rank feeds one backward pass")
    parser.add_argument("--batches-per-allreduce", type=int, default=2,
                        help="backward passes whose gradients a rank adds up before each allreduce")
    parser.add_argument("--base-lr", type=float, default=0.0125, help="the learning rate of one rank and one part")
    parser.add_argument("--warmup-epochs", type=float, default=2)
    parser.add_argument("--decay-epochs", type=int, nargs="*", default=[7, 9],
                        help="epochs after which the learning rate drops tenfold")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-5)
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 writes checkpoint-<epoch>.pt")
    parser.add_argument("--workers", type=int, default=1, help="data loading processes a rank starts")
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--sync-batch-norm", action="store_true")
    return parser.parse_args()


class ResidualBlock(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


def resnet(width=16, blocks=2):
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
        *[ResidualBlock(width) for _ in range(blocks)],
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10))


def checkpoint_path(directory, epoch):
    return os.path.join(directory, "checkpoint-%d.pt" % epoch)


def last_checkpoint_epoch(args):
    """Rank 0 looks; every rank learns the answer from it, so that ranks
    that see another file system (or none) still agree."""
    epoch = 0
    if hvd.rank() == 0 and args.checkpoint_dir:
        epoch = max((e for e in range(args.epochs, 0, -1) if os.path.exists(checkpoint_path(args.checkpoint_dir, e))),
                    default=0)
    return int(hvd.broadcast(torch.tensor(epoch), root_rank=0, name="resume_from_epoch").item())


def learning_rate(args, epoch, batch, batches_per_epoch):
    """Warmup to the scaled rate, then tenfold drops (Goyal et al.'s rule,
    as Horovod's ImageNet example applies it)."""
    scaled = args.base_lr * hvd.size() * args.batches_per_allreduce
    if args.use_adasum:
        scaled = args.base_lr * args.batches_per_allreduce  # Adasum needs no scaling with the ranks
    progress = epoch + (batch + 1) / batches_per_epoch
    if progress < args.warmup_epochs:
        return args.base_lr + (scaled - args.base_lr) * progress / args.warmup_epochs
    return scaled * 0.1 ** sum(epoch >= d for d in args.decay_epochs)


def averaged(value, name):
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def loader_options(args):
    options = {"num_workers": args.workers}
    # Workers started by a fork inherit the parent's threads and sockets
    # half-copied; a fork server starts them clean (the recipe's advice,
    # for network stacks that are not fork-safe).
    if args.workers > 0 and "forkserver" in multiprocessing.get_all_start_methods():
        options["multiprocessing_context"] = "forkserver"
        options["persistent_workers"] = True
    return options


def main():
    args = parse_arguments()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(42 + hvd.rank())  # different on purpose: the broadcasts below align the ranks

    digits = np.load(DIGITS)
    x_train, x_test = (torch.tensor(digits[part] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
                       for part in ("x_train", "x_test"))
    y_train, y_test = torch.tensor(digits["y_train"]), torch.tensor(digits["y_test"])
    train_set = torch.utils.data.TensorDataset(x_train, y_train)
    # The sampler pads the set so every rank gets as many rows as the others.
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=hvd.size(),
                                                                    rank=hvd.rank(), seed=0)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size * args.batches_per_allreduce,
                                               sampler=train_sampler, **loader_options(args))

    model = resnet()
    if args.sync_batch_norm:
        model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    resume_from_epoch = last_checkpoint_epoch(args)
    if resume_from_epoch > 0 and hvd.rank() == 0:
        saved = torch.load(checkpoint_path(args.checkpoint_dir, resume_from_epoch))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if resume_from_epoch > 0 and hvd.rank() == 0:
        print("resumed from epoch %d on %d ranks" % (resume_from_epoch, hvd.size()), flush=True)

    for epoch in range(resume_from_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        loss_sum, correct, rows = 0.0, 0, 0
        for batch, (data, target) in enumerate(train_loader):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, epoch, batch, len(train_loader))
            optimizer.zero_grad()
            # The batch in parts, each its own backward pass: the gradients
            # add up, and the loss is divided so they add up to the mean.
            parts = math.ceil(len(data) / args.batch_size)
            for start in range(0, len(data), args.batch_size):
                output = model(data[start:start + args.batch_size])
                loss = torch.nn.functional.cross_entropy(output, target[start:start + args.batch_size])
                (loss / parts).backward()
                loss_sum += loss.item() * len(output)
                correct += (output.argmax(1) == target[start:start + args.batch_size]).sum().item()
                rows += len(output)
            optimizer.step()
        train_loss = averaged(loss_sum / rows, "train_loss")
        train_accuracy = averaged(correct / rows, "train_accuracy")

        model.eval()
        with torch.no_grad():
            # Every rank scores the whole (small) test set; a larger one
            # would be sharded and averaged like the training metrics.
            test_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if hvd.rank() == 0:
            print("epoch %d: lr %.4f, train loss %.4f, train accuracy %.3f, test accuracy %.3f"
                  % (epoch + 1, optimizer.param_groups[0]["lr"], train_loss, train_accuracy, test_accuracy),
                  flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           checkpoint_path(args.checkpoint_dir, epoch + 1))

    model.eval()
    with torch.no_grad():
        test_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    # The parameters, not the batch-norm layers' running statistics: each
    # rank keeps those from its own shard (SyncBatchNorm makes them agree).
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    identical = bool(torch.equal(hvd.broadcast(weights, root_rank=0, name="final_weights"), weights))
    identical = hvd.allreduce(torch.tensor(int(identical)), op=hvd.Min, name="identical").item() == 1
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks; weights identical on every rank: %s"
              % (test_accuracy, hvd.size(), identical), flush=True)


if __name__ == "__main__":
    main()
