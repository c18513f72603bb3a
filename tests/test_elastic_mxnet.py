"""Elastic MXNet Gluon (MXNetState over a DistributedTrainer) under the
elastic launcher with two simulated hosts: a worker dies mid-step and the
job finishes on the rest; a host appears and the job grows. The final
parameters are those of one process on the same committed steps."""
import os
import sys

import pytest

pytest.importorskip("mxnet")
from jobs import HERE, discovery_script, elastic_job  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "elastic"))
from reference import STEPS, mxnet_reference  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def check_final(events, size):
    finals = [e for worker in events.values() for e in worker if e["event"] == "final"]
    assert len(finals) == 1 and finals[0]["size"] == size and finals[0]["step"] == STEPS, finals
    for name, values in mxnet_reference(STEPS).items():
        assert finals[0]["params"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


def test_mxnet_job_survives_a_killed_worker(tmp_path):
    proc, events = elastic_job(tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1"],
                               "train_mxnet.py", env={"ELASTIC_FAULT": "127.0.0.1:0@9:sigkill"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    check_final(events, 2)
    resumed = [e for w in events.values() for e in w if e["event"] == "sync" and e["size"] == 2]
    assert {e["step"] for e in resumed} == {9}, resumed


def test_mxnet_job_grows_when_a_host_is_added(tmp_path):
    script, listing = discovery_script(tmp_path, ["localhost:1"])
    proc, events = elastic_job(tmp_path, ["-np", "1", "--max-np", "3", "--host-discovery-script", script],
                               "train_mxnet.py", env={"ELASTIC_ADD": "5:%s:127.0.0.1:2" % listing, "ELASTIC_GROW_TO": "3"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    check_final(events, 3)
    for worker in ("127.0.0.1:0", "127.0.0.1:1"):
        synced = [e for e in events[worker] if e["event"] == "sync"]
        assert len(synced) == 1 and synced[0]["step"] > 5
