"""The timeline of a torch training step, from one rank's point of view:
hvd.start_timeline()/stop_timeline() around DistributedOptimizer steps
give rank 0's file a row per gradient (allreduce.<parameter>) with its
queued, negotiating and allreduce phases."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
import unison  # noqa: E402
import unison.torch as hvd  # noqa: E402
from unison import timeline  # noqa: E402

hvd.init()
torch.set_num_threads(1)


def test_a_training_step_shows_every_gradient():
    path = "/tmp/unison-timeline-torch-%s.json" % os.environ.get("UNISON_JOB_ID", "solo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.start_timeline(path)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    hvd.stop_timeline()
    hvd.barrier()
    with open(path) as f:
        spans = timeline.spans(json.load(f))
    backend = unison.backend_name().upper()
    for name, _ in model.named_parameters():
        phases = [phase for row, phase, _, _, _ in spans if row == "allreduce." + name]
        assert phases.count("QUEUED") == 2 and phases.count("NEGOTIATE") == 2, (name, phases)
        assert phases.count(backend + "_ALLREDUCE") == 2, (name, phases)
