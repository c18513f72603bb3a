"""Runs each suite in tests/parallel under the launcher with 2 and 3 ranks
(odd sizes find bugs), and more or fewer where a suite needs them
(sizes()). Each rank runs pytest on the same file; a test that hangs is
failed by pytest-timeout inside the ranks and by the timeout here."""
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import fake_cuda as fake_cuda_library
import layouts
from jobs import assert_every_rank_passed, failure_digest, pytest_command, run_job

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = sorted(f for f in os.listdir(os.path.join(HERE, "parallel")) if f.startswith("test_"))
# Suites for a framework run in that framework's tox env (tox.ini); an env
# without the framework installed leaves them to it.
FRAMEWORKS = {"test_torch_": "torch", "test_mxnet_": "mxnet", "test_tensorflow_": "tensorflow",
              "test_keras_": "tensorflow", "test_lightning_": "lightning"}


def framework_of(suite):
    for prefix, module in FRAMEWORKS.items():
        if suite.startswith(prefix):
            return module
    return None


# Process sets need 4 ranks: two disjoint pairs, and sets that overlap them.
# The shared grid (parallel/shared_grid.py) also runs on one rank, where
# every collective must still give the single-process answer; so do the GPU
# suites, where one rank is the NCCL path (more ranks share the one GPU).
# The reduction kernel has a path per input count up to 8 and one beyond
# (test_core_wide.py). The core's own suites of ops and errors run at 5
# ranks too, where a test's constants no longer stand out from the rank
# count: at 5 ranks a refusal test's 5 rows once added up to its splits.
def sizes(suite):
    if "process_sets" in suite:
        return [2, 3, 4]
    if suite == "test_core_wide.py":
        return [2, 3, 5, 8, 9]
    if suite == "test_core_grid.py":
        return [1, 2, 3, 5]
    if suite == "test_core_fuzz.py":  # the two sizes: one rank, and ranks that negotiate
        return [1, 2]
    if suite.endswith("_grid.py") or suite.endswith("_cuda.py"):
        return [1, 2, 3]
    if suite in ("test_core_ops.py", "test_core_errors.py"):
        return [2, 3, 5]
    return [2, 3]


# One launch per framework and size, running every suite of that framework
# that runs at that size in one pytest session inside each rank: a launch
# costs each rank its interpreter, pytest and the framework's import (3-4 s
# a rank for torch or TensorFlow on a 2-core machine), which one launch per
# suite paid 20 times over in each framework's env. Each test of each suite
# still runs under its own per-test timeout inside the ranks.
def launches(suites, sizes_of):
    """{(framework, ranks): [suite, ...]} for the given suites."""
    groups = {}
    for suite in suites:
        for n in sizes_of(suite):
            groups.setdefault((framework_of(suite) or "core", n), []).append(suite)
    return groups


LAUNCHES = launches(SUITES, sizes)


def launch_id(key):
    return "%s-np%d" % key


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launch", sorted(LAUNCHES), ids=launch_id)
def test_suites_under_launcher(launch):
    run_suites(LAUNCHES[launch], launch[1])


# Async ops start at once on the engine's thread only where the host has a
# core to spare per rank (UNISON_OVERLAP=auto, engine_driver.cc); on a
# machine without one (CI's 2 cores) the suites above run without overlap,
# so these force it on.
# GPU tensors: the torch grid on CUDA tensors, at 1 rank (NCCL) and at 2
# and 3 ranks sharing one GPU (host staging). test_torch_cuda.py is among
# the suites above. Where there is no GPU both skip, saying so.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [1, 2, 3], ids=lambda v: "np%d" % v)
def test_torch_grid_on_cuda_tensors(np_):
    skip_without_cuda()
    run_suite("test_torch_grid.py", np_, {"UNISON_TEST_DEVICE": "cuda"})


# Ranks given as hosts of their own each have the GPU to themselves as far
# as unison can tell, so their planes are NCCL's: hierarchical (a one-rank
# NCCL communicator per host, TCP across), or flat across the "hosts" with
# UNISON_HIERARCHICAL_ALLREDUCE=0. A flat communicator on one GPU needs NCCL
# to believe it too: NCCL_HOSTID, per rank, makes NCCL treat each rank as
# a host of its own and move bytes over its sockets, so the NCCL plane's
# multi-rank paths run on a one-GPU machine.
A_HOST_PER_RANK = {2: "tcp-1+1", 3: "tcp-1+1+1"}  # rows of tests/layouts.py
NCCL_PER_RANK_HOST = ["sh", "-c", 'NCCL_HOSTID="unison-test-$UNISON_HOSTNAME" exec "$@"', "sh"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("suite", ["test_torch_cuda.py", "test_torch_grid.py"])
@pytest.mark.parametrize("flat", [False, True], ids=["hierarchical", "flat"])
@pytest.mark.parametrize("np_", [2, 3], ids=lambda v: "np%d" % v)
def test_cuda_suites_with_a_host_per_rank(suite, flat, np_):
    skip_without_cuda()
    env = {"UNISON_TEST_DEVICE": "cuda", "NCCL_SOCKET_IFNAME": "lo"}
    if flat:
        env["UNISON_HIERARCHICAL_ALLREDUCE"] = "0"
    run_suite(suite, np_, env, launcher=layouts.LAYOUTS[A_HOST_PER_RANK[np_]].launcher,
              wrapper=NCCL_PER_RANK_HOST if flat else [])


def torch_has_cuda():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.cuda.is_available()


def skip_without_cuda():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here; the tox env 'torch' runs the GPU suites")
    if not torch_has_cuda():
        pytest.skip("no CUDA device here: the GPU suites run on a GPU machine (benchmarks/gpu_machine.sh)")


# The shared grid on the GPU path, where there is no GPU: tests/fake_cuda
# stands in for CUDA and NCCL (tests/parallel/fake_gpu.py says how its
# arrays are made and read). First the GPU machine's layouts, one GPU that
# its ranks share: NCCL at one rank, host staging at one rank and with
# ranks sharing the GPU, and the hierarchical NCCL plane with a host per
# rank. Then hosts of several GPUs (FAKE_CUDA_DEVICES), a GPU per local
# rank, which only a multi-GPU machine would otherwise show: the flat NCCL
# plane at 2, 3 and 4 ranks (allgather as broadcasts, alltoall as sends
# and receives, reducescatter as reduces), the hierarchical one with two
# GPUs a host (the grouped reduces and broadcasts within it), on uneven
# hosts, and the flat plane across hosts, which
# UNISON_HIERARCHICAL_ALLREDUCE=0 asks for.
FAKE_GPU_LAYOUTS = {  # the row of tests/layouts.py, environment, the plane its collectives must run on
    "np1-nccl": ("solo-np1", {}, "nccl"),
    "np1-staging": ("solo-np1", {"UNISON_GPU_DATA_PLANE": "staging"}, "staging"),
    "np2-staging": ("shm-np2", {}, "staging"),
    "np3-staging": ("shm-np3", {}, "staging"),
    "np2-hierarchical-nccl": ("tcp-1+1", {}, "nccl_hierarchical"),
    "np3-hierarchical-nccl": ("tcp-1+1+1", {}, "nccl_hierarchical"),
    "np2-nccl-2-gpus": ("shm-np2", {"FAKE_CUDA_DEVICES": "2"}, "nccl"),
    "np3-nccl-3-gpus": ("shm-np3", {"FAKE_CUDA_DEVICES": "3"}, "nccl"),
    "np4-nccl-4-gpus": ("shm-np4", {"FAKE_CUDA_DEVICES": "4"}, "nccl"),  # disjoint process sets, each its communicator
    "np4-hierarchical-nccl-2-gpus-a-host": ("tcp-2x2", {"FAKE_CUDA_DEVICES": "2"}, "nccl_hierarchical"),
    "np3-hierarchical-nccl-uneven-hosts": ("tcp-2+1", {"FAKE_CUDA_DEVICES": "2"}, "nccl_hierarchical"),
    "np3-flat-nccl-across-hosts": ("tcp-1+1+1", {"UNISON_HIERARCHICAL_ALLREDUCE": "0"}, "nccl"),
}


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory):
    return fake_cuda_library.build(str(tmp_path_factory.mktemp("fake_cuda")))


@pytest.fixture(scope="module")
def fake_cuda_without_nccl(tmp_path_factory):
    return fake_cuda_library.build(str(tmp_path_factory.mktemp("fake_cuda_without_nccl")), nccl=False)


def fake_cuda_env(fake_cuda, **env):
    return dict(env, UNISON_TEST_FAKE_CUDA=fake_cuda,
                LD_LIBRARY_PATH=os.pathsep.join(filter(None, [os.path.dirname(fake_cuda),
                                                              os.environ.get("LD_LIBRARY_PATH")])))


def run_the_grid_on_the_fake_gpu(fake_cuda, tmp_path, layout, env, plane):
    timeline = tmp_path / "timeline.json"
    run_suite("test_core_grid.py", layouts.ranks(layout),
              fake_cuda_env(fake_cuda, UNISON_TEST_DEVICE="fake-cuda", UNISON_TIMELINE=str(timeline), **env),
              launcher=layouts.LAYOUTS[layout].launcher)
    # Rank 0's timeline names each collective's plane: the layout ran where
    # it was meant to, not on a fallback.
    ran = set(re.findall(r'"name": *"([A-Z_]+)"', timeline.read_text()))
    for op in ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"]:
        assert "%s_%s" % (plane.upper(), op) in ran, sorted(ran)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", FAKE_GPU_LAYOUTS)
def test_core_grid_on_a_fake_gpu(fake_cuda, layout, tmp_path):
    run_the_grid_on_the_fake_gpu(fake_cuda, tmp_path, *FAKE_GPU_LAYOUTS[layout])


# A GPU per rank, but no NCCL on the machine: the collectives are staged
# through host memory, and --check-build says why.
@pytest.mark.timeout(600)
def test_core_grid_on_fake_gpus_without_nccl_is_staged(fake_cuda_without_nccl, tmp_path):
    env = {"FAKE_CUDA_DEVICES": "2"}
    said = check_build_on_the_fake_gpu(fake_cuda_without_nccl, **env)
    assert ("CUDA: libcudart.so.13 (runtime 13.0), 2 device(s); NCCL: not found (libnccl.so.2 could not be opened"
            in said and "GPU collectives are staged through host memory" in said), said
    run_the_grid_on_the_fake_gpu(fake_cuda_without_nccl, tmp_path, "shm-np2", env, "staging")


def check_build_on_the_fake_gpu(fake_cuda, **env):
    return subprocess.run([sys.executable, "-m", "unison.run", "--check-build"], stdout=subprocess.PIPE, timeout=60,
                          env=dict(os.environ, **fake_cuda_env(fake_cuda, **env))).stdout.decode()


def test_check_build_names_the_cuda_and_nccl_it_found(fake_cuda):
    said = check_build_on_the_fake_gpu(fake_cuda, FAKE_CUDA_DEVICES="3")
    assert ("GPU support (found at run time): CUDA: libcudart.so.13 (runtime 13.0), 3 device(s); "
            "NCCL: libnccl.so.2 (2.28.3)" in said), said


# NCCL asked for (UNISON_GPU_DATA_PLANE=nccl) where it cannot serve: every
# rank's GPU op is refused, naming the setting and why (where NCCL is
# missing, why it could not be loaded), and not once only; the ranks' host
# ops still run.
NCCL_ASKED_FOR = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import unison
import unison.numpy as unp
import fake_gpu
unison.init()
for attempt in range(2):
    try:
        fake_gpu.api.allreduce(fake_gpu.to_device(np.ones(3, np.float32)), name="on.the.gpu", op=unison.Sum)
        print("not refused", flush=True)
    except unison.UnisonError as e:
        print("refused: %s" % e, flush=True)
print("on the host after: %s" % unp.allreduce(np.ones(3, np.float32), name="on.the.host", op=unison.Sum).tolist(),
      flush=True)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nccl,why", [(True, "ranks 0 and 1 share one GPU (0000:01:00.0 on "),
                                      (False, "rank 0 could not load NCCL (on this rank: libnccl.so.2 could "
                                              "not be opened")], ids=["gpu-shared", "no-nccl"])
def test_nccl_asked_for_where_it_cannot_serve_is_refused(fake_cuda, fake_cuda_without_nccl, tmp_path, nccl, why):
    script = tmp_path / "asked.py"
    script.write_text(NCCL_ASKED_FOR)
    env = fake_cuda_env(fake_cuda if nccl else fake_cuda_without_nccl, UNISON_GPU_DATA_PLANE="nccl",
                        FAKE_CUDA_DEVICES="1" if nccl else "2")
    command = [sys.executable, "-m", "unison.run", "-np", "2", sys.executable, str(script),
               os.path.join(HERE, "parallel")]
    output = run_job(command, 150, env=dict(os.environ, **env), cwd=str(tmp_path)).stdout.decode(errors="replace")
    refused = [line for line in output.splitlines() if "refused: " in line]
    assert len(refused) == 4 and all("unison: UNISON_GPU_DATA_PLANE=nccl on rank 0, but " + why in line
                                     for line in refused), output[-5000:]
    assert output.count("on the host after: [2.0, 2.0, 2.0]") == 2, output[-5000:]


# A rank lost in the middle of an NCCL collective: the survivor's kernel
# waits for bytes that will never come, and its stream, and every stream
# ordered after it, with it; no handle is pending (they complete at launch),
# so only the plane knows. The survivor's engine must see the loss and abort
# NCCL, so that its device work ends and its next op names the rank. Rank
# 1's stream is held for seconds before its input is ready ({stall}), so
# its own part of the collective never starts before it exits.
LOST_MID_COLLECTIVE = """
import os, sys, time
import numpy as np
import unison
{setup}
hvd.allreduce_(x, name="warm", op=hvd.Sum)
{synchronize}
if unison.rank() == 1:
    {stall}
    hvd.allreduce_async_(x, name="lost", op=hvd.Sum)
    time.sleep(2)
    os._exit(3)
start = time.monotonic()
hvd.synchronize(hvd.allreduce_async_(x, name="lost", op=hvd.Sum))
{synchronize}
print("survivor: device work ended after %.1f s" % (time.monotonic() - start), flush=True)
try:
    hvd.allreduce(x, name="after", op=hvd.Sum)
except unison.UnisonError as e:
    print("survivor: the next op failed: %s" % e, flush=True)
    os._exit(17)
"""
# x.add_(0) loads the add kernel before the stall: CUDA loads a kernel's
# code at its first launch, and that waits for the running kernels, so a
# first x.add_(1) behind the stall held rank 1's thread until the stall
# ended (seen on an H200), and its part of the collective then ran.
LOST_ON_CUDA = dict(
    setup='import torch\nimport unison.torch as hvd\nhvd.init()\ntorch.cuda.set_device(0)\n'
          'x = torch.ones(1 << 20, device="cuda")\nx.add_(0)',
    stall="torch.cuda._sleep(int(2e10)); x.add_(1)", synchronize="torch.cuda.synchronize()")
LOST_ON_THE_FAKE_GPU = dict(  # numpy arrays in the fake's memory (tests/parallel/fake_gpu.py)
    setup="sys.path.insert(0, sys.argv[1])\nimport fake_gpu\nhvd = fake_gpu.api\nunison.init()\n"
          "x = fake_gpu.to_device(np.ones(1 << 16, np.float32))",
    stall="fake_gpu._library.fake_cuda_delay(fake_gpu.STREAM, 20 * 1000 * 1000)",
    synchronize="fake_gpu.synchronize()")


def assert_the_survivor_of_a_lost_rank_goes_on(tmp_path, script, env, wrapper=()):
    path = tmp_path / "lost.py"
    path.write_text(LOST_MID_COLLECTIVE.format(**script))
    env = dict(os.environ, UNISON_HIERARCHICAL_ALLREDUCE="0", UNISON_GPU_DATA_PLANE="nccl", **env)
    command = [sys.executable, "-m", "unison.run", *layouts.options("tcp-1+1"), "--failure-grace-seconds", "60",
               *wrapper, sys.executable, str(path), os.path.join(HERE, "parallel")]
    proc = run_job(command, 150, env=env, cwd=str(tmp_path))
    output = proc.stdout.decode(errors="replace")
    ended = [line for line in output.splitlines() if "survivor: device work ended" in line]
    assert len(ended) == 1 and float(ended[0].split("after ")[1].split(" s")[0]) < 10, output[-5000:]
    assert "survivor: the next op failed" in output and "rank 1" in output.split("the next op failed")[1], \
        output[-5000:]


@pytest.mark.timeout(200)
def test_cuda_rank_lost_mid_nccl_collective_ends_the_survivors_device_work(tmp_path):
    skip_without_cuda()
    assert_the_survivor_of_a_lost_rank_goes_on(tmp_path, LOST_ON_CUDA, {"NCCL_SOCKET_IFNAME": "lo"},
                                               wrapper=NCCL_PER_RANK_HOST)


@pytest.mark.timeout(200)
def test_rank_lost_mid_fake_nccl_collective_ends_the_survivors_device_work(fake_cuda, tmp_path):
    assert_the_survivor_of_a_lost_rank_goes_on(tmp_path, LOST_ON_THE_FAKE_GPU, fake_cuda_env(fake_cuda))


# NCCL's init blocks until every rank of the communicator has joined. Here
# rank 1's goes wrong after the ids went round, where rank 0 is already
# inside its own: it fails (FAKE_NCCL_INIT_FAILURES: the fake's first init
# on rank 1 returns an error without joining), or the process dies in it
# (FAKE_NCCL_INIT_EXITS). Rank 0 must hear of it within seconds and name
# rank 1, not wait inside NCCL for good. After a failure both ranks are
# still usable: the next GPU op makes a new communicator and gives the sum.
NCCL_INIT_GOES_WRONG = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
if os.environ["UNISON_RANK"] == "1":
    os.environ[sys.argv[2]] = "1"
import numpy as np
import unison
import fake_gpu
unison.init()
rank = unison.rank()
x = fake_gpu.to_device(np.full(3, rank + 1, np.float32))
start = time.monotonic()
try:
    fake_gpu.api.allreduce(x, name="first", op=unison.Sum)
    print("rank %d: the first GPU op ran" % rank, flush=True)
except unison.UnisonError as e:
    print("rank %d: the first GPU op failed after %.1f s: %s" % (rank, time.monotonic() - start, e), flush=True)
try:
    y = fake_gpu.api.allreduce(x, name="second", op=unison.Sum)
    fake_gpu.synchronize()
    print("rank %d: the second GPU op gave %s" % (rank, fake_gpu.to_host(y).tolist()), flush=True)
except unison.UnisonError as e:
    print("rank %d: the second GPU op failed: %s" % (rank, e), flush=True)
    os._exit(17)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("goes_wrong", ["FAKE_NCCL_INIT_FAILURES", "FAKE_NCCL_INIT_EXITS"], ids=["fails", "exits"])
def test_a_rank_whose_nccl_init_goes_wrong_is_named_to_its_peers(fake_cuda, tmp_path, goes_wrong):
    script = tmp_path / "init.py"
    script.write_text(NCCL_INIT_GOES_WRONG)
    env = fake_cuda_env(fake_cuda, UNISON_GPU_DATA_PLANE="nccl", FAKE_CUDA_DEVICES="2")
    command = [sys.executable, "-m", "unison.run", "-np", "2", "--failure-grace-seconds", "60", sys.executable,
               str(script), os.path.join(HERE, "parallel"), goes_wrong]
    left_before = set(glob.glob("/dev/shm/unison-fake-nccl-*"))
    try:
        output = run_job(command, 150, env=dict(os.environ, **env), cwd=str(tmp_path)).stdout.decode(errors="replace")
    finally:  # the communicator rank 1 never joined stays named
        for name in set(glob.glob("/dev/shm/unison-fake-nccl-*")) - left_before:
            os.unlink(name)
    failed = [line for line in output.splitlines() if "rank 0: the first GPU op failed after " in line]
    assert len(failed) == 1 and float(failed[0].split("after ")[1].split(" s")[0]) < 10, output[-5000:]
    if goes_wrong == "FAKE_NCCL_INIT_FAILURES":
        assert failed[0].endswith("unison: rank 1 could not set up NCCL (ncclCommInitRank (2 ranks) failed: NCCL "
                                  "error 2 (system error: shared memory for the communicator (fake NCCL)))"), failed
        assert re.search(r"rank 1: the first GPU op failed after [0-9.]+ s: unison: ncclCommInitRank \(2 ranks\) "
                         r"failed: NCCL error 2", output), output[-5000:]
        for rank in range(2):
            assert "rank %d: the second GPU op gave [3.0, 3.0, 3.0]" % rank in output, output[-5000:]
    else:
        assert "rank 1" in failed[0].split("failed after ")[1], failed
        assert "rank 0: the second GPU op failed" in output, output[-5000:]


# The same on a GPU machine, with a real NCCL: rank 1's init cannot find the
# network interface it is told to use, while rank 0's waits for it.
NCCL_INIT_FAILS_ON_CUDA = """
import os, sys, time
if os.environ["UNISON_RANK"] == "1":
    os.environ["NCCL_SOCKET_IFNAME"] = "unison-no-such-interface"
import torch
import unison
import unison.torch as hvd
hvd.init()
rank = hvd.rank()
torch.cuda.set_device(0)
start = time.monotonic()
try:
    hvd.allreduce(torch.ones(4, device="cuda"), name="first", op=hvd.Sum)
    torch.cuda.synchronize()
    print("rank %d: the first GPU op ran" % rank, flush=True)
except unison.UnisonError as e:
    print("rank %d: the first GPU op failed after %.1f s: %s" % (rank, time.monotonic() - start, e), flush=True)
print("rank %d: on the host after: %s" % (rank, hvd.allreduce(torch.ones(3), name="host", op=hvd.Sum).tolist()),
      flush=True)
"""


@pytest.mark.timeout(200)
def test_cuda_rank_whose_nccl_init_fails_is_named_to_its_peers(tmp_path):
    skip_without_cuda()
    script = tmp_path / "init.py"
    script.write_text(NCCL_INIT_FAILS_ON_CUDA)
    env = dict(os.environ, UNISON_GPU_DATA_PLANE="nccl", UNISON_HIERARCHICAL_ALLREDUCE="0", NCCL_SOCKET_IFNAME="lo")
    command = [sys.executable, "-m", "unison.run", *layouts.options("tcp-1+1"), *NCCL_PER_RANK_HOST, sys.executable,
               str(script)]
    output = run_job(command, 150, env=env, cwd=str(tmp_path)).stdout.decode(errors="replace")
    failed = [line for line in output.splitlines() if "rank 0: the first GPU op failed after " in line]
    assert len(failed) == 1 and float(failed[0].split("after ")[1].split(" s")[0]) < 30, output[-5000:]
    assert "unison: rank 1 could not set up NCCL (ncclCommInitRank (2 ranks) failed: NCCL error" in failed[0], failed
    for rank in range(2):
        assert "rank %d: on the host after: [2.0, 2.0, 2.0]" % rank in output, output[-5000:]


# NCCL's collectives can fail after they were queued, as when the network
# goes: the kernel hangs, and only ncclCommGetAsyncError says so. Here rank
# 1's fake NCCL does that (FAKE_NCCL_ASYNC_ERROR) to an allreduce whose
# handle completed at launch, as a GPU op's does. Its engine must notice,
# abort the communicator so that its streams go on, and fail its next op
# with NCCL's reason. Rank 0's kernel waits for rank 1's bytes meanwhile,
# and must end too, however rank 1 goes on:
# - it exits: rank 0 ends its work as after any lost rank;
# - it shuts unison down and lives on, as an elastic job's reset does: that
#   looks like any orderly shutdown to rank 0, whose stopped engine gives
#   the work the peer timeout to finish, then aborts it.
NCCL_FAILS_ASYNCHRONOUSLY = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import unison
import fake_gpu
hvd = fake_gpu.api
unison.init()
rank = unison.rank()
x = fake_gpu.to_device(np.ones(1 << 10, np.float32))
hvd.allreduce_(x, name="warm", op=unison.Sum)
fake_gpu.synchronize()
if rank == 1:
    os.environ["FAKE_NCCL_ASYNC_ERROR"] = "1"
start = time.monotonic()
hvd.synchronize(hvd.allreduce_async_(x, name="broken", op=unison.Sum))
fake_gpu.synchronize()
print("rank %d: device work ended after %.1f s" % (rank, time.monotonic() - start), flush=True)
try:
    hvd.allreduce(x, name="after", op=unison.Sum)
    print("rank %d: the next op ran" % rank, flush=True)
except unison.UnisonError as e:
    print("rank %d: the next op failed (%s): %s" % (rank, type(e).__name__, e), flush=True)
if rank == 1 and sys.argv[2] == "shuts-down":
    unison.shutdown()
    # Alive, until rank 0 has ended its device work and said so.
    deadline = time.monotonic() + 60
    while not os.path.exists("rank0.done") and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)
if rank == 0:
    open("rank0.done", "w").close()
os._exit(17)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("then", ["exits", "shuts-down"])
def test_an_asynchronous_nccl_error_ends_the_device_work_and_fails_the_next_op(fake_cuda, tmp_path, then):
    script = tmp_path / "async.py"
    script.write_text(NCCL_FAILS_ASYNCHRONOUSLY)
    env = fake_cuda_env(fake_cuda, UNISON_GPU_DATA_PLANE="nccl", FAKE_CUDA_DEVICES="2", UNISON_PEER_TIMEOUT_SECONDS="5")
    command = [sys.executable, "-m", "unison.run", "-np", "2", "--failure-grace-seconds", "60", sys.executable,
               str(script), os.path.join(HERE, "parallel"), then]
    output = run_job(command, 150, env=dict(os.environ, **env), cwd=str(tmp_path)).stdout.decode(errors="replace")
    lines = output.splitlines()

    def ended_after(rank):
        ended = [line for line in lines if "rank %d: device work ended after " % rank in line]
        assert len(ended) == 1, output[-5000:]
        return float(ended[0].split("after ")[1].split(" s")[0])

    assert ended_after(1) < 10, output[-5000:]
    assert ("rank 1: the next op failed (UnisonInternalError): unison: NCCL's communicator on GPU 1 failed: NCCL "
            "error 6 (remote process exited or there was a network error (fake NCCL)), with collectives still "
            "running; they were aborted" in output), output[-5000:]
    # Rank 1 told rank 0 why it stopped before it exited or shut down
    # (Backend::stopped_on): rank 0 fails with rank 1's reason, and its own
    # device work, which a peer that stopped on something other than a lost
    # rank may still have been finishing, gets the peer timeout, then is aborted.
    assert 4 < ended_after(0) < 30, output[-5000:]
    failed = [line for line in lines if "rank 0: the next op failed (UnisonInternalError): unison: NCCL's "
              "communicator on GPU 1 failed: NCCL error 6" in line]
    assert len(failed) == 1 and re.search(r"; rank 1 \(pid \d+\) stopped on that$", failed[0]), output[-5000:]
    assert "unison: GPU collectives queued before this rank stopped had not finished 5 s later" in output, \
        output[-5000:]


OVERLAP_LAUNCHES = launches(["test_core_ops.py", "test_core_grid.py", "test_core_timeline.py",
                             "test_torch_optimizer.py", "test_torch_zero.py"], lambda suite: [2, 3])


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("launch", sorted(OVERLAP_LAUNCHES), ids=launch_id)
def test_suites_with_overlap_forced_on(launch):
    run_suites(OVERLAP_LAUNCHES[launch], launch[1], {"UNISON_OVERLAP": "1"})


# A spinning wait yields its core where ranks outnumber cores
# (UNISON_SPIN_YIELD=auto, config.cc): on CI's 2 cores the 3-rank runs
# above yield and the 2-rank runs do not; on a larger machine none would.
# These force each way, so both waits run wherever the tests do.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("np_,spin_yield", [(2, "1"), (3, "0")], ids=["np2-yield", "np3-pause"])
def test_suites_with_spin_yield_forced(np_, spin_yield):
    run_suites(["test_core_ops.py", "test_core_grid.py"], np_, {"UNISON_SPIN_YIELD": spin_yield})


# The shared grid's join test as a long loop (tests/join_loop.py): 20 x 210
# joins, each rank in turn joining first, with the response cache on and
# off. A join that ended while ranks took the next op at different cycles
# once left them waiting for good, in a few runs in ten.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cache", ["cache-on", "cache-off"])
@pytest.mark.parametrize("np_", [2, 3], ids=lambda v: "np%d" % v)
def test_many_joins_in_a_row_never_wait_for_good(np_, cache):
    env = dict(os.environ, UNISON_CACHE_CAPACITY="1024" if cache == "cache-on" else "0")
    command = [sys.executable, "-m", "unison.run", "-np", str(np_), sys.executable, os.path.join(HERE, "join_loop.py"),
               "20", "210"]
    output = run_job(command, 580, env=env).stdout.decode(errors="replace")
    for rank in range(np_):
        assert "[%d]<stdout>:rank %d: 4200 joins" % (rank, rank) in output, failure_digest(output)


def run_suite(suite, np_, env=None, launcher=(), wrapper=()):
    run_suites([suite], np_, env, launcher, wrapper)


# TensorFlow's XLA lowering (tf_adapter/kernels_xla.cc) is built the first
# time a collective is traced under XLA: in the ranks, inside whichever test
# traces one first. Its headers alone take a compiler some 40 CPU-s; on a
# slow 2-core VM shared with the other envs (a run under .ci/throttled 1.15)
# the build outlived that test's 120 s timeout in every TensorFlow launch.
# So the launches' ranks find it built: it is built here once, with the
# kernels, into the cache they read, under a build's own time limit. A
# failed build is not judged here; the ranks build again and the suites
# show what it means.
@functools.lru_cache(maxsize=None)
def build_extensions_for_the_ranks(framework):
    if framework != "tensorflow":
        return
    script = "import unison.tensorflow\nfrom unison.tensorflow import kernels\nkernels.xla_problem()\n"
    subprocess.run([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)


def run_suites(suites, np_, env=None, launcher=(), wrapper=()):
    """The suites, one after another, in one job of np_ ranks."""
    if not torch_has_cuda():  # a GPU suite among others is left out; alone, it skips saying why
        suites = [s for s in suites if not s.endswith("_cuda.py")]
        if not suites:
            skip_without_cuda()
    framework = framework_of(suites[0])
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip("%s is not installed here; the tox env '%s' runs these suites" % (framework, framework))
    build_extensions_for_the_ranks(framework)
    command = [sys.executable, "-m", "unison.run", "-np", str(np_), *launcher, *wrapper, *pytest_command(*suites)]
    # Each suite gets what one launch of it alone had.
    assert_every_rank_passed(run_job(command, 580 * len(suites), env=dict(os.environ, **(env or {}))), np_)


# The ranks' own per-test time limit (the watchdog in parallel/conftest.py,
# which pytest_command turns on), here 2 s for the job. The first test
# outlives it but sets a limit of its own with a marker, and passes. In the
# second, rank 0 waits in an allreduce that rank 1 never joins, blocked in
# native code: the watchdog must still end it at 2 s, naming the test and
# showing where every thread was, and the launcher then ends rank 1, which
# sleeps under a longer limit of its own.
HANGS = '''
import os
import time
import numpy as np
import pytest
import unison.numpy as unp

RANK = int(os.environ["UNISON_RANK"])

@pytest.mark.timeout(30)
def test_takes_longer_than_the_job_limit_but_sets_its_own():
    time.sleep(4)  # past the 2 s limit by more than the watchdog's 1 s poll

@pytest.mark.timeout(2 if RANK == 0 else 60)
def test_hangs():
    if RANK == 0:
        unp.allreduce(np.ones(4), name="never.joined")
    else:
        time.sleep(3600)
'''


@pytest.mark.timeout(120)
def test_a_test_that_hangs_in_the_ranks_fails_the_job_with_every_threads_stack(tmp_path):
    shutil.copy(os.path.join(HERE, "parallel", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_hangs.py").write_text(HANGS)
    command = [sys.executable, "-m", "unison.run", "-np", "2", *pytest_command(seconds=2), "test_hangs.py"]
    started = time.monotonic()
    proc = run_job(command, 60, cwd=str(tmp_path))
    took = time.monotonic() - started
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output
    assert "test_takes_longer" not in output, output  # it passed: no report names it
    assert output.count("E   ran past its time limit of") == 1, output
    digest = failure_digest(output)
    assert digest.startswith("each rank's first failure"), digest
    assert "unison test: test_hangs.py::test_hangs failed in call on rank 0:\nE   ran past its time limit of 2 s" in digest
    # Rank 0's stack, its own thread last: in the test, in the allreduce.
    assert re.search(r"test_hangs\.py:\d+: in test_hangs\n.*numpy\.py:\d+: in allreduce", digest, re.S), digest
    assert "rank 0 exited with status 1" in output, output
    assert took < 40, took
