"""The timeline's cost on training, and a picture of one training step.

    unisonrun -np 2 python benchmarks/timeline.py [--png docs/img/timeline.png]

Trains torch_train.py's MLP with unison's DistributedOptimizer in
alternating blocks, the timeline off and on (hvd.start_timeline and
stop_timeline between blocks), so both see the same machine noise; each
figure is the median over blocks of the slowest rank's samples/s. Then it
records a few steps and, with --png, renders one step of rank 0's trace
with matplotlib: a row per gradient, coloured by phase, and the fused
groups' rows with shared memory's parts.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

import unison
import unison.torch as hvd
from unison import timeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import make_model, slowest  # noqa: E402

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

COLOURS = {"QUEUED": "#c7c7c7", "WAIT_FOR_DATA": "#ffd966", "NEGOTIATE": "#f2a65a", "PACK": "#7fb3d5",
           "WAIT_FOR_PEERS": "#e06666", "REDUCE": "#6aa84f", "REDUCE_INTO_OUTPUT": "#6aa84f",
           "UNPACK": "#8e7cc3"}
COLLECTIVE_COLOUR = "#3d85c6"  # a tensor's collective (SHM_ALLREDUCE, ...), drawn narrow


def train_block(model, optimizer, x, y, steps):
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return slowest(time.perf_counter() - start)


def render(trace, png, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = timeline.spans(timeline.load(trace))
    queued = [(start, row) for row, phase, start, _, _ in spans if phase == "QUEUED"]
    # Backward queues the first layer's weight last: one such start per step.
    last_of_step = sorted(start for start, row in queued if row.endswith(".0.weight"))
    # The second-to-last step: the gradients queued after the step before's
    # last one, up to its own last; shown until the next step's first.
    after = last_of_step[-3] if len(last_of_step) > 2 else float("-inf")
    upto = last_of_step[-2] if len(last_of_step) > 1 else last_of_step[-1]
    begin = min(start for start, _ in queued if after < start <= upto)
    until = min([start for start, _ in queued if start > upto], default=float("inf"))
    shown = [s for s in spans if begin <= s[2] < until]
    rows = []
    for row, *_ in sorted(shown, key=lambda s: s[2]):
        if row not in rows:
            rows.append(row)
    figure, axes = plt.subplots(figsize=(12, 0.28 * len(rows) + 1.5))
    # The collectives first (narrow), their parts over them (full height).
    for row, phase, start, duration, _ in sorted(shown, key=lambda s: s[1] in COLOURS):
        y = rows.index(row)
        colour = COLOURS.get(phase, COLLECTIVE_COLOUR)
        height = 0.8 if phase in COLOURS else 0.4
        axes.barh(y, duration / 1e3, left=(start - begin) / 1e3, height=height, color=colour, edgecolor="none")
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(rows, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the step's first gradient was queued")
    axes.set_title(title, fontsize=9)
    present = {phase for _, phase, _, _, _ in shown}
    labels = [p for p in COLOURS if p in present and p != "REDUCE_INTO_OUTPUT"] + ["the collective"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(p, COLLECTIVE_COLOUR)) for p in labels]
    axes.legend(handles, labels, fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--png", help="render one step of the trace here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    x, y = torch.randn(args.batch_size, args.width), torch.randint(0, 10, (args.batch_size,))
    model = make_model(args.width, args.depth)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    folder = tempfile.mkdtemp(prefix="unison-timeline-bench-") if rank == 0 else "/tmp"
    trace = os.path.join(folder, "overhead.json")
    train_block(model, optimizer, x, y, 3)  # warm up
    off, on = [], []
    for block in range(args.blocks):
        for with_timeline in ((False, True) if block % 2 == 0 else (True, False)):
            if with_timeline:
                hvd.start_timeline(trace)
            seconds = train_block(model, optimizer, x, y, args.steps)
            if with_timeline:
                hvd.stop_timeline()
            (on if with_timeline else off).append(args.steps * args.batch_size * hvd.size() / seconds)
    events = len(timeline.load(trace)) if rank == 0 else 0
    if rank == 0:
        off_median, on_median = statistics.median(off), statistics.median(on)
        print("samples/s, %d ranks, %d x %d MLP, %d blocks of %d steps each way:" % (
            hvd.size(), args.depth, args.width, args.blocks, args.steps))
        print("  timeline off  %8.0f" % off_median)
        print("  timeline on   %8.0f   (%d events in the last block's file)" % (on_median, events))
        print("  on / off      %8.3f" % (on_median / off_median))
    if args.png:
        picture = os.path.join(folder, "picture.json")
        hvd.start_timeline(picture)
        train_block(model, optimizer, x, y, 3)
        hvd.stop_timeline()
        if rank == 0:
            render(picture, args.png, "One training step on rank 0 of %d: %d x %d MLP, %s backend" % (
                hvd.size(), args.depth, args.width, unison.backend_name()))
            print("rendered %s" % args.png)


if __name__ == "__main__":
    main()
