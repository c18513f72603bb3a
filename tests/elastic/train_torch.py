"""An elastic torch job for tests/test_elastic.py and the fault-injection
benchmark. Every step trains on one fixed global batch, sharded over
whatever ranks the round has, and sums gradients: the parameters after N
committed steps are those of one process on the whole batches, whatever
sizes the job went through.

ELASTIC_STEPS (default 24) sets the steps, ELASTIC_PLAIN=1 makes it a plain
job without the elastic API (for the fault-injection benchmark); faults.py
says how a test injects faults and adds hosts.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import fault_at, log, maybe_add_host, timed_kill_window, wait_for_growth  # noqa: E402
from reference import BATCH, STEPS, batch_of, make_torch_model, make_torch_optimizer  # noqa: E402

import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)
steps = int(os.environ.get("ELASTIC_STEPS", STEPS))
step_seconds = float(os.environ.get("ELASTIC_STEP_SECONDS", "0.02"))


def one_step(model, optimizer, step):
    inputs, targets = (torch.from_numpy(a) for a in batch_of(step))
    mine = slice(hvd.rank(), None, hvd.size())
    optimizer.zero_grad()
    loss = ((model(inputs[mine]) - targets[mine]) ** 2).sum() / BATCH
    loss.backward()
    fault_at(step)
    optimizer.step()
    time.sleep(step_seconds)


def main():
    hvd.init()
    model = make_torch_model()
    optimizer = hvd.DistributedOptimizer(make_torch_optimizer(model), named_parameters=model.named_parameters(),
                                         op=hvd.Sum)
    if os.environ.get("ELASTIC_PLAIN"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(steps):
            one_step(model, optimizer, step)
        log(event="done", rank=hvd.rank(), size=hvd.size())
        return

    state = hvd.elastic.TorchState(model, optimizer, step=0)

    @hvd.elastic.run
    def train(state):
        log(event="sync", rank=hvd.rank(), size=hvd.size(), step=state.step,
            weight=state.model.weight.detach().flatten().tolist())
        while state.step < steps:
            timed_kill_window(state.step, steps)
            maybe_add_host(state.step, hvd.rank())
            wait_for_growth(state.step, hvd.size(), state.commit)
            one_step(state.model, state.optimizer, state.step)
            state.step += 1
            state.commit()

    train(state)
    if hvd.rank() == 0:
        log(event="final", size=hvd.size(), step=state.step,
            params={k: v.flatten().tolist() for k, v in model.state_dict().items()})
    log(event="done", rank=hvd.rank(), size=hvd.size())


if __name__ == "__main__":
    main()
