"""What the ranks of the engines' tests run (Ray's actors in
tests/test_ray*.py, Spark's tasks in tests/test_spark.py). Module-level, so
that each engine pickles the functions by reference and its workers import
this file (the tests put tests/ on their PYTHONPATH)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic"))
from reference import BATCH, STEPS, batch_of, make_torch_model, make_torch_optimizer, torch_reference  # noqa: E402


def assert_reference_parameters(params):
    """What the tests assert of a rank's parameters after train(): those of
    one process on the whole batches."""
    import pytest
    for name, values in torch_reference(STEPS).items():
        assert params[name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


def _unison_torch():
    import torch
    torch.set_num_threads(1)
    import unison.torch as hvd
    hvd.init()
    return torch, hvd


def collectives(scale):
    """This rank's place and what it computed from every rank's values:
    rank r contributes scale * (r + 1)."""
    torch, hvd = _unison_torch()
    mine = torch.full((3,), scale * (hvd.rank() + 1), dtype=torch.float64)
    return {
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "host": os.environ["UNISON_HOSTNAME"],
        "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist(),
        "gathered": hvd.allgather(mine[:1] + torch.arange(hvd.rank() + 1, dtype=torch.float64),
                                  name="gathered").tolist(),
        "from_last": hvd.broadcast(mine, root_rank=hvd.size() - 1, name="from_last").tolist(),
        "pid": os.getpid(), "extra": os.environ.get("ENGINE_TEST_EXTRA"),
    }


class Executable:
    """The object RayExecutor.start(executable_cls=...) makes in each actor."""

    def __init__(self, offset, times=1):
        _, hvd = _unison_torch()
        self.rank, self.offset, self.times = hvd.rank(), offset, times

    def value(self):
        return self.offset + self.times * self.rank


def fails_on(rank):
    """Rank `rank` raises before the collective its peers wait in."""
    torch, hvd = _unison_torch()
    if hvd.rank() == rank:
        raise ValueError("rank %d fails on purpose" % rank)
    return hvd.allreduce(torch.ones(2), name="never_complete").tolist()


def dies_on(rank):
    """Rank `rank`'s process ends at once, as one killed would."""
    torch, hvd = _unison_torch()
    if hvd.rank() == rank:
        os._exit(3)
    return hvd.allreduce(torch.ones(2), name="never_complete").tolist()


def says_hello():
    _, hvd = _unison_torch()
    print("hello from rank %d of %d" % (hvd.rank(), hvd.size()))
    return hvd.rank()


def _step(torch, hvd, model, optimizer, step):
    inputs, targets = (torch.from_numpy(a) for a in batch_of(step))
    shard = slice(hvd.rank(), None, hvd.size())
    optimizer.zero_grad()
    (((model(inputs[shard]) - targets[shard]) ** 2).sum() / BATCH).backward()
    optimizer.step()


def _parameters(model):
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def train(steps=STEPS):
    """STEPS steps on shards of each global batch, gradients summed: the
    parameters of one process on the whole batches (reference.torch_reference)."""
    torch, hvd = _unison_torch()
    model = make_torch_model()
    optimizer = hvd.DistributedOptimizer(make_torch_optimizer(model), named_parameters=model.named_parameters(),
                                         op=hvd.Sum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        _step(torch, hvd, model, optimizer, step)
    return {"rank": hvd.rank(), "size": hvd.size(), "params": _parameters(model)}


def elastic_train(victim_marker, victim_step=9):
    """An elastic job: the last rank of the first round kills its own
    process at victim_step (once: victim_marker records it), and the rest
    roll back to their last commit and go on with whoever is left or comes."""
    torch, hvd = _unison_torch()
    model = make_torch_model()
    optimizer = hvd.DistributedOptimizer(make_torch_optimizer(model), named_parameters=model.named_parameters(),
                                         op=hvd.Sum)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    sizes = []

    @hvd.elastic.run
    def loop(state):
        sizes.append((hvd.size(), state.step))
        while state.step < STEPS:
            if state.step == victim_step and hvd.rank() == hvd.size() - 1 and not os.path.exists(victim_marker):
                open(victim_marker, "w").close()
                os.kill(os.getpid(), 9)
            _step(torch, hvd, state.model, state.optimizer, state.step)
            state.step += 1
            state.commit()
            time.sleep(0.02)

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "rounds": sizes, "step": state.step,
            "params": _parameters(model)}


def train_loop_for_ray_train(config):
    """Ray Train's training function: trains as train() does, and writes
    what this worker saw to config["folder"]."""
    import ray.train
    import unison.torch as hvd
    result = train()
    context = ray.train.get_context()
    result.update(world_rank=context.get_world_rank(), ray_local_rank=context.get_local_rank(),
                  world_size=context.get_world_size(), local_rank=hvd.local_rank())
    with open(os.path.join(config["folder"], "worker%d.json" % result["rank"]), "w") as f:
        json.dump(result, f)
    ray.train.report({"rank": result["rank"]})


def elastic_train_as_nodes_change(folder):
    """An elastic job while the test changes the cluster: from step 6 rank 0
    asks for a node to go (the file `lose`) and the ranks train slowly until
    the job has shrunk; from step 12 of the shrunken job it asks for a node
    to come (`grow`) and the ranks wait, committing, until the job has grown
    back (the commit raises HostsUpdatedInterrupt once the driver sees it)."""
    torch, hvd = _unison_torch()
    model = make_torch_model()
    optimizer = hvd.DistributedOptimizer(make_torch_optimizer(model), named_parameters=model.named_parameters(),
                                         op=hvd.Sum)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    first_size, sizes = hvd.size(), []

    def ask(what):
        if hvd.rank() == 0 and not os.path.exists(os.path.join(folder, what)):
            open(os.path.join(folder, what), "w").close()

    @hvd.elastic.run
    def loop(state):
        sizes.append((hvd.size(), state.step))
        while state.step < STEPS:
            if state.step >= 6 and hvd.size() == first_size and not os.path.exists(os.path.join(folder, "grow")):
                ask("lose")
                time.sleep(0.2)  # slow steps, until the lost node's workers are missed
            if state.step >= 12 and hvd.size() < first_size:
                ask("grow")
                while True:
                    time.sleep(0.05)
                    state.commit()
            _step(torch, hvd, state.model, state.optimizer, state.step)
            state.step += 1
            state.commit()

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "rounds": sizes, "step": state.step,
            "host": os.environ["UNISON_HOSTNAME"], "params": _parameters(model)}

