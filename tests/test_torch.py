"""unison.torch in one process without the launcher (rank 0 of 1), and
misuse outside a job."""
import re
import subprocess
import sys

import pytest

from jobs import assert_every_rank_passed, pytest_command, run_job, unisonrun

torch = pytest.importorskip("torch")
import unison.torch as hvd  # noqa: E402


@pytest.fixture
def solo():
    hvd.init()
    yield
    hvd.shutdown()


def test_size_one_collectives_are_identities(solo):
    assert (hvd.rank(), hvd.size()) == (0, 1)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(hvd.allreduce(x), x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    assert torch.equal(hvd.alltoall(x), x)
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert hvd.join() == 0


def test_distributed_optimizer_at_size_one_is_the_plain_optimizer(solo):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    twin = torch.nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for net, opt in ((model, optimizer), (twin, plain)):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_use_before_init_is_a_clear_error():
    with pytest.raises(hvd.UnisonError, match="init"):
        hvd.allreduce(torch.ones(1))
    with pytest.raises(hvd.UnisonError, match="on meta; unison moves CPU and CUDA tensors"):
        hvd.init()
        try:
            hvd.allreduce(torch.ones(1, device="meta"))
        finally:
            hvd.shutdown()


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["unison-first", "dynamo-first"])
def test_torch_compile_skips_all_of_unison_but_its_traced_files_whichever_is_imported_first(dynamo_first):
    # Dynamo is loaded by torch.compile, 1.5 s into a program's life or
    # never: importing unison.torch must not load it, and the skip must be
    # in place whenever it does load.
    script = """
import sys
%s
import unison.torch, unison.torch.ops, unison.frontend
assert ("torch._dynamo" in sys.modules) == %s, "importing unison.torch loaded Dynamo"
from torch._dynamo import trace_rules
from unison.torch import graph_ops, ops, optimizer, registered_ops, sync_batch_norm
for module in (unison.frontend, unison.handles, unison.basics, optimizer, registered_ops):
    result = trace_rules.check_file(module.__file__)
    assert result.skipped, (module.__file__, result.reason)
for module in (ops, graph_ops, sync_batch_norm):   # what Dynamo traces to the unison:: operators
    result = trace_rules.check_file(module.__file__)
    assert not result.skipped, (module.__file__, result.reason)
print("skipped")
""" % ("import torch._dynamo" if dynamo_first else "", dynamo_first)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "skipped" in done.stdout, done.stderr


def test_num_groups_split_as_every_framework_splits():
    # 7 parameters in 5 groups: Horovod's split, the first groups one longer.
    from unison.arguments import split_into_groups
    from unison.torch.optimizer import _assign_groups
    params = [torch.zeros(1) for _ in range(7)]
    assignment = _assign_groups(5, params)
    sizes = [sum(1 for p in params if assignment[p] == g) for g in range(5)]
    assert sizes == [len(g) for g in split_into_groups(params, 5)] == [2, 2, 1, 1, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_trainer_crash_in_rpc_training_is_reported_on_every_other_rank(tmp_path, np_):
    # Rank 0 serves a table over RPC and waits in unison.torch.rpc.shutdown();
    # the trainers step a hybrid DistributedOptimizer; rank 1 dies mid-step.
    # Every survivor learns it, naming rank 1, within seconds, with no hang.
    import textwrap
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, warnings
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as torch_rpc
        import unison.torch as hvd
        from unison.torch import rpc
        torch.set_num_threads(1)
        table = None
        def make_table():
            global table
            if table is None:
                table = torch.nn.Parameter(torch.zeros(10, 4))
            return table
        def lookup(i):
            return torch.nn.functional.embedding(i, table)
        hvd.init()
        rpc.init_rpc()
        trainers = hvd.add_process_set(list(range(1, hvd.size())))
        try:
            if hvd.rank() == 0:
                rpc.shutdown()
            else:
                ref = torch_rpc.remote("worker0", make_table)
                head = torch.nn.Linear(4, 1)
                opt = rpc.DistributedOptimizer(torch.optim.SGD, [ref], lr=0.1, process_set=trainers,
                                               dense_optimizer=torch.optim.SGD(head.parameters(), lr=0.1))
                for step in range(1000):
                    if hvd.rank() == 1 and step == 3:
                        # The survivors time their report from this moment:
                        # a rank's own start would also count the other
                        # ranks' start-up, which a loaded CI machine stretches.
                        with open("died_at", "w") as f:
                            f.write(repr(time.time()))
                        os._exit(3)
                    with dist_autograd.context() as cid:
                        rows = torch_rpc.rpc_sync("worker0", lookup, args=(torch.tensor([1, 2]),))
                        dist_autograd.backward(cid, [head(rows).sum()])
                        opt.step(cid)
        except hvd.UnisonError as e:
            with open("died_at") as f:
                died_at = float(f.read())
            print("survivor %d reported after %.1f s: %s" % (hvd.rank(), time.time() - died_at, e), flush=True)
            if hvd.rank() == 0:
                # The server keeps answering until unisonrun ends it: were it
                # to exit at once, a trainer mid-request would see torch's own
                # "eof" from the server before unison's error naming rank 1.
                time.sleep(60)
            os._exit(17)
    """))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), sys.executable, str(script)], 100,
                   cwd=str(tmp_path), stderr=subprocess.PIPE)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    survivors = [line for line in out.splitlines() if "survivor" in line]
    assert len(survivors) == np_ - 1, out + err
    for line in survivors:
        assert "rank 1 (pid" in line and float(line.split("after ")[1].split(" s")[0]) < 10, line
    assert "unisonrun: job failed: rank 1" in err and "exited with status 3" in err


@pytest.mark.timeout(600)
@pytest.mark.parametrize("hosts,np_", [("localhost:1,127.0.0.1:1", 2), ("localhost:2,127.0.0.1:1", 3)])
def test_rpc_suite_across_hosts(hosts, np_):
    """The remote-parameter suite in a job that spans two hosts (two names
    for this machine): rank 0 must offer torch's RPC an address the other
    host can reach, not the loopback a one-host job uses."""
    proc = unisonrun(["-np", str(np_), "-H", hosts], pytest_command("test_torch_rpc.py"), timeout=580)
    assert_every_rank_passed(proc, np_)


# (optimizer, backward_on, model): each runs in turn in one job per size, so
# each also shows that the job is left clean by the deadlock before it.
BRANCH_CASES = [("distributed", "caller", "linear"), ("distributed", "worker", "linear"), ("zero", "worker", "linear"),
                ("distributed", "worker", "syncbn")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_takes_another_branch_mid_training_fails_every_rank_instead_of_hanging(tmp_path, np_):
    # Rank 0 averages a metric at step 2 that the others skip. They finish
    # step 2 (rank 0's gradients were already in) and wait on step 3's in
    # optimizer.step(); rank 0 waits on 'metric'. Every rank gets the
    # deadlock report, the optimizers that failed are ready for another
    # backward, and the job's collectives go on. backward_on="worker" runs
    # backward on a thread of its own that lives on, as PyTorch runs a GPU's
    # backward: the hooks start the allreduces there, and that idle thread
    # must not count as a busy rank. ZeroRedundancyOptimizer's hooks start
    # its reductions there too, and SyncBatchNorm's backward its allreduce:
    # with it the others finish step 2 and wait in step 3's forward.
    # The cases share one job (each rank imports torch once, not four
    # times): each case's report must name only its own collectives, and
    # the next case trains from a clean start.
    import textwrap
    script = tmp_path / "branch.py"
    script.write_text(textwrap.dedent("""
        import concurrent.futures, sys
        import torch
        import unison
        import unison.torch as hvd
        torch.set_num_threads(1)
        hvd.init()

        def run_case(case, optimizer, backward_on, model_kind):
            worker = concurrent.futures.ThreadPoolExecutor(1) if backward_on == "worker" else None
            def backward(loss):
                if worker is None:
                    loss.backward()
                else:
                    worker.submit(loss.backward).result()
            torch.manual_seed(0)
            if model_kind == "syncbn":
                model = torch.nn.Sequential(torch.nn.Linear(4, 3), hvd.SyncBatchNorm(3, name="bn"),
                                            torch.nn.Linear(3, 1))
            else:
                model = torch.nn.Linear(4, 1)
            if optimizer == "zero":
                opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
            else:
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            for step in range(5):
                opt.zero_grad()
                try:
                    backward(model(torch.arange(8.0).reshape(2, 4) * (hvd.rank() + 1)).sum())
                    if step == 2 and hvd.rank() == 0:
                        hvd.allreduce(torch.ones(1), name="metric")
                    opt.step()
                except unison.DeadlockError as e:
                    # On one line, so that the test can tell the cases apart.
                    print("case %d rank %d step %d: %s" % (case, hvd.rank(), step, str(e).replace("\\n", " | ")),
                          flush=True)
                    break
            if hvd.rank() != 0:
                opt.zero_grad()  # the failed step() left no allreduce in flight
                print("case %d rank %d zero_grad ok" % (case, hvd.rank()), flush=True)
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
            print("case %d rank %d after: %s" % (case, hvd.rank(), total), flush=True)
            # Its idle thread lives on into the next cases, as a framework's
            # backward thread would.

        for case, spec in enumerate(sys.argv[1:]):
            run_case(case, *spec.split(","))
    """))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), "--stall-check-warning-time-seconds",
                    "1.5", sys.executable, str(script)] + [",".join(case) for case in BRANCH_CASES], 220,
                   cwd=str(tmp_path), stderr=subprocess.PIPE)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    others = "[%s]" % ", ".join(str(r) for r in range(1, np_))
    for case, (optimizer, _, model) in enumerate(BRANCH_CASES):
        tag = "case %d " % case
        mine = "\n".join(line[line.index(tag) + len(tag):] for line in out.splitlines() if tag in line)
        for r in range(np_):
            # ZeroRedundancyOptimizer's step first agrees, by an allreduce,
            # whether to send the gradients again: the others wait there,
            # still in step 2.
            step = 2 if r == 0 or optimizer == "zero" else 3
            assert ("rank %d step %d: unison: deadlock: every rank is blocked" % (r, step)) in mine, out
            assert ("rank %d after: %d.0" % (r, np_)) in mine, out
            assert r == 0 or ("rank %d zero_grad ok" % r) in mine, out
        # Each report names this case's collectives and no earlier case's:
        # 'metric' and the others' one wait (a linear model's weight and
        # bias are two).
        reports = [line for line in mine.splitlines() if "deadlock" in line]
        waits = 3 if (optimizer, model) == ("distributed", "linear") else 2
        assert len(reports) == np_ and all(line.count(" waited ") == waits for line in reports), out
        # The ages depend on when each rank last moved: any will do.
        assert re.search(r"allreduce 'metric' waited \d+ s: submitted by ranks \[0\], missing from ranks "
                         + re.escape(others), mine), out
        theirs = {"linear": "allreduce 'allreduce.weight'", "syncbn": "allgather 'bn.stats'"}[model]
        if optimizer == "zero":
            theirs = r"allreduce 'zero\d+\.again'"
        assert re.search(theirs + r" waited \d+ s: submitted by ranks " + re.escape(others)
                         + r", missing from ranks \[0\]", mine), out
