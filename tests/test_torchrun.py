"""Jobs that torchrun starts, with no unisonrun in sight: unison.init()
takes torchrun's environment (common/runner/torchrun.py). Kubeflow's
PyTorchJob, TorchX, SageMaker and Spark's TorchDistributor all start
their workers through torchrun."""
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from jobs import HERE, assert_every_rank_passed, pytest_command, run_job
from unison import exceptions, network
from unison.runner import torchrun

TORCH = {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1",
         "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run 7", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_torchruns_variables_become_unisons_identity_and_horovods():
    ids = torchrun.identity(TORCH)
    assert {k: ids[k] for k in ("UNISON_RANK", "UNISON_SIZE", "UNISON_LOCAL_RANK", "UNISON_LOCAL_SIZE",
                                "UNISON_CROSS_RANK", "UNISON_CROSS_SIZE")} == {
        "UNISON_RANK": "4", "UNISON_SIZE": "6", "UNISON_LOCAL_RANK": "1", "UNISON_LOCAL_SIZE": "3",
        "UNISON_CROSS_RANK": "1", "UNISON_CROSS_SIZE": "2"}
    assert ids["HOROVOD_RANK"] == "4" and ids["HOROVOD_LOCAL_SIZE"] == "3"
    # One host per agent; the run id (the user's text) hashed into a name.
    assert ids["UNISON_HOSTNAME"] == socket.gethostname() + "-node1"
    assert ids["UNISON_JOB_ID"].startswith("torchrun-") and " " not in ids["UNISON_JOB_ID"]
    # Another restart is another job.
    assert torchrun.identity(dict(TORCH, TORCHELASTIC_RESTART_COUNT="1"))["UNISON_JOB_ID"] != ids["UNISON_JOB_ID"]


def test_only_a_worker_that_torchrun_started_and_unisonrun_did_not_is_one():
    assert torchrun.started_by_torchrun(TORCH)
    assert not torchrun.started_by_torchrun(dict(TORCH, UNISON_RANK="4"))
    assert not torchrun.started_by_torchrun({"RANK": "0", "WORLD_SIZE": "2"})  # no torchrun agent


@pytest.mark.parametrize("name,value,said", [
    ("RANK", "x", "RANK='x'"), ("LOCAL_WORLD_SIZE", "-1", "LOCAL_WORLD_SIZE='-1'"),
    ("RANK", "6", "RANK=6, WORLD_SIZE=6"), ("GROUP_RANK", "2", "GROUP_RANK=2 and GROUP_WORLD_SIZE=2")])
def test_bad_torchrun_variables_are_named_with_their_values(name, value, said):
    with pytest.raises(exceptions.UnsupportedError, match="unison: .*" + said.replace("(", r"\(")):
        torchrun.identity(dict(TORCH, **{name: value}))


def test_a_job_across_agents_needs_the_agents_store():
    env = dict(TORCH, TORCHELASTIC_USE_AGENT_STORE="False", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    with pytest.raises(exceptions.UnsupportedError, match="TORCHELASTIC_USE_AGENT_STORE='False'"):
        torchrun.adopt(dict(env), timeout_seconds=1)


def without_unisonrun(**extra):
    """This environment less anything a unison launcher sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNISON_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def torchrun_command(*options):
    return [sys.executable, "-m", "torch.distributed.run"] + list(options)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [2, 3])
def test_the_shared_grid_under_torchrun_on_one_node(np_):
    pytest.importorskip("torch", reason="torch is not installed here; the tox env 'torch' runs this")
    proc = run_job(torchrun_command("--nproc-per-node", str(np_), "--no-python") +
                   pytest_command("test_core_grid.py"), 280, env=without_unisonrun(UNISON_TEST_EXPECT_BACKEND="shm"))
    assert_every_rank_passed(proc, np_)


@pytest.mark.timeout(300)
def test_the_shared_grid_across_two_torchrun_agents():
    """Two agents on this machine, two workers each: shared memory within an
    agent, TCP between them, the rendezvous agreed in the agents' store."""
    pytest.importorskip("torch", reason="torch is not installed here; the tox env 'torch' runs this")
    port = str(network.a_port_nobody_takes_by_chance("127.0.0.1"))
    env = without_unisonrun(UNISON_TEST_EXPECT_BACKEND="hierarchical")
    agents = [subprocess.Popen(torchrun_command("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                                "--master-addr", "127.0.0.1", "--master-port", port, "--no-python") +
                               pytest_command("test_core_grid.py"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, cwd=HERE, env=env) for node in (0, 1)]
    outputs = [agent.communicate(timeout=280)[0] for agent in agents]
    proc = subprocess.CompletedProcess("torchrun", max(a.returncode for a in agents), b"\n".join(outputs))
    assert_every_rank_passed(proc, 4)


RESTARTED = """
import os, sys, numpy as np, unison, unison.numpy as unp
unison.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = unp.allreduce(np.array([unison.rank() + 1.0]), op=unison.Sum, name="x")
if attempt == 0 and unison.rank() == 1:
    os._exit(5)  # torchrun's agent restarts every worker
if attempt == 0:
    unp.allreduce(np.ones(1), name="never")  # the dead rank's peer fails here
print("attempt %d rank %d: %s, job %s" % (attempt, unison.rank(), total.tolist(), os.environ["UNISON_JOB_ID"]),
      flush=True)
"""


@pytest.mark.timeout(300)
def test_a_restart_by_torchrun_starts_a_clean_session(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed here; the tox env 'torch' runs this")
    script = tmp_path / "restarted.py"
    script.write_text(textwrap.dedent(RESTARTED))
    proc = run_job(torchrun_command("--nproc-per-node", "2", "--max-restarts", "1", str(script)), 280,
                   env=without_unisonrun())
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    # Found anywhere, the job id by its exact form: the two workers share
    # torchrun's stdout, and their lines can run together.
    finished = sorted(re.findall(r"attempt (\d) rank (\d): \[([\d.]+)\], job (torchrun-[0-9a-f]{16})", out))
    assert [(attempt, rank, total) for attempt, rank, total, _ in finished] == [("1", "0", "3.0"), ("1", "1", "3.0")], out
    assert finished[0][3] == finished[1][3], out  # one job, the restart's own
