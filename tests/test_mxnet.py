"""unison.mxnet jobs whose ranks go astray, under the launcher: the
collectives run on MXNet's engine threads, and a deadlock must still be
told from a busy rank (unison.mxnet.engine)."""
import re
import subprocess
import sys
import textwrap

import pytest

from jobs import run_job

pytest.importorskip("mxnet")

# Rank 0 takes a branch the others do not.
BRANCH = """
    import mxnet as mx
    from mxnet import autograd, gluon
    import unison
    import unison.mxnet as hvd
    hvd.init()
    r = hvd.rank()
    x = mx.nd.ones((2,))
    hvd.broadcast_(x, root_rank=0, name="start")
    if WHERE == "blocking":
        def step():
            if r == 0:
                hvd.allreduce(x, op=hvd.Sum, name="metric")
            hvd.allreduce(x, op=hvd.Sum, name="loss")
    else:  # rank 0 averages a metric where the others are in trainer.step, on the gradients
        model = gluon.nn.Dense(1, in_units=2)
        model.initialize(mx.init.Constant(0.5))
        hvd.broadcast_parameters(model.collect_params(), root_rank=0)
        trainer = hvd.DistributedTrainer(model.collect_params(), "sgd", {"learning_rate": 0.1})
        def step():
            with autograd.record():
                loss = model(x.reshape((1, 2))).sum()
            loss.backward()
            if r == 0:
                hvd.allreduce(x, op=hvd.Sum, name="metric")
            trainer.step(1)
    try:
        step()
    except unison.DeadlockError as e:
        print("rank %d: %s" % (r, e), flush=True)
    total = hvd.allreduce(mx.nd.array([r + 1.0]), op=hvd.Sum, name="after")
    print("rank %d after: %s" % (r, total.asnumpy().tolist()), flush=True)
"""


def lines_of(out, rank):
    return "\n".join(line for line in out.splitlines() if line.startswith("[%d]<stdout>:" % rank))


@pytest.mark.parametrize("where", ["blocking", "trainer-step"])
@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_that_part_fail_as_a_deadlock_then_go_on(tmp_path, np_, where):
    # Before, MXNet's engine threads started every collective and counted as
    # submitters for good, busy whenever they were not waiting in unison,
    # while the caller waited on an event: such a job warned forever. Now
    # the engine thread counts only while it starts an op, and the caller
    # waits on the core's handle itself.
    path = tmp_path / "job.py"
    path.write_text("WHERE = %r\n" % where + textwrap.dedent(BRANCH))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), "--stall-check-warning-time-seconds", "2",
                    sys.executable, str(path)], 240, cwd=str(tmp_path), stderr=subprocess.PIPE)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    for r in range(np_):
        mine = lines_of(out, r)
        assert ("rank %d: unison: deadlock: every rank is blocked" % r) in mine, out + err
        assert re.search(r"allreduce 'metric' waited \d+ s: submitted by ranks \[0\]", mine), out
        assert ("rank %d after: [%s]" % (r, float(np_ * (np_ + 1) // 2))) in out, out


# Rank 0 is late (busy for twice the warning time) but takes the same path.
LATE = """
    import time
    import mxnet as mx
    import unison.mxnet as hvd
    hvd.init()
    r = hvd.rank()
    x = mx.nd.ones((2,))
    hvd.broadcast_(x, root_rank=0, name="start")
    if r == 0:
        deadline = time.time() + 4
        while time.time() < deadline:   # computing, not waiting in unison
            (mx.nd.ones((64, 64)) * 2).wait_to_read()
    total = hvd.allreduce(mx.nd.array([r + 1.0]), op=hvd.Sum, name="after")
    print("rank %d after: %s" % (r, total.asnumpy().tolist()), flush=True)
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_a_late_rank_is_not_a_deadlock(tmp_path, np_):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(LATE))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), "--stall-check-warning-time-seconds", "1",
                    sys.executable, str(path)], 240, cwd=str(tmp_path), stderr=subprocess.PIPE)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "deadlock" not in out + err, out + err
    assert "some ranks have waited more than 1 s" in err, out + err   # it was noticed, and only warned
    for r in range(np_):
        assert ("rank %d after: [%s]" % (r, float(np_ * (np_ + 1) // 2))) in out, out
