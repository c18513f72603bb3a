"""unison.torch on CUDA tensors: the plane chosen, ordering with the
caller's stream, core-allocated device results, and training on a model on
the GPU against one process on the whole batch.

Needs a CUDA device. At 1 rank the collectives go through NCCL; at 2 and 3
ranks the ranks share the one GPU of the test machine, which NCCL refuses,
so they go through host staging (native/cuda/device_plane.h). Given as
hosts of their own (`-H localhost:1,127.0.0.1:1`), the ranks take the
hierarchical NCCL plane (NCCL within each host, TCP across), or with
UNISON_HIERARCHICAL_ALLREDUCE=0 the flat one (tests/test_parallel.py). The
shared grid runs on CUDA too (test_torch_grid.py with
UNISON_TEST_DEVICE=cuda).
benchmarks/gpu_machine.sh runs both; CI, with no GPU, skips them with the
reason."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU suites run on a GPU machine (benchmarks/gpu_machine.sh)",
                allow_module_level=True)
import unison  # noqa: E402
import unison.torch as hvd  # noqa: E402
from unison import collective  # noqa: E402
from unison._native import ffi, lib  # noqa: E402

torch.set_num_threads(1)
DEVICE = torch.device("cuda", 0)


def rank_values(rank, n=1000, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64) + 1000 * rank).to(dtype).to(DEVICE)


def expected_sum(n=1000):
    return sum(torch.arange(n, dtype=torch.float64) + 1000 * r for r in range(hvd.size()))


def expected_plane():
    """The plane every rank should have chosen, from what each says of itself:
    staging where two ranks share a host (and so the one GPU) or it is asked
    for; across hosts, NCCL hierarchical unless flat is asked for; else NCCL."""
    hosts = hvd.allgather_object(os.environ.get("UNISON_HOSTNAME", "this machine"), name="plane.hosts")
    if os.environ.get("UNISON_GPU_DATA_PLANE") == "staging" or len(set(hosts)) < len(hosts):
        return "STAGING"
    if len(set(hosts)) > 1 and os.environ.get("UNISON_HIERARCHICAL_ALLREDUCE") != "0":
        return "NCCL_HIERARCHICAL"
    return "NCCL"


def test_the_plane_chosen(tmp_path_factory):
    plane = expected_plane()
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "plane.json")
    path = hvd.broadcast_object(path, 0, name="plane.path")
    hvd.start_timeline(path)
    result = hvd.allreduce(rank_values(hvd.rank()), op=hvd.Sum, name="plane.probe")
    hvd.stop_timeline()
    assert torch.equal(result.cpu().double(), expected_sum())
    if hvd.rank() == 0:
        with open(path) as f:
            text = f.read()
        assert '"%s_ALLREDUCE"' % plane in text, text[:2000]
    hvd.barrier()


def test_a_fused_group_of_many_unaligned_tensors():
    # More tensors than one batched copy takes (64), of odd lengths, some
    # starting off 16-byte alignment (views one element in), so the packing
    # and unpacking take every path of the copy kernel; Average and a
    # postscale run on the fused buffer.
    n = hvd.size()
    tensors = []
    for i in range(150):
        dtype = [torch.float32, torch.float16, torch.float64][i % 3]
        base = (torch.arange(i + 2, dtype=torch.float64) + 10 * hvd.rank() + i).to(dtype).to(DEVICE)
        tensors.append(base[1:] if i % 2 else base[:-1])
    outputs = hvd.grouped_allreduce(tensors, op=hvd.Average, postscale_factor=2.0, name="fused.many")
    for i, out in enumerate(outputs):
        start = 1 if i % 2 else 0
        values = torch.arange(start, start + i + 1, dtype=torch.float64) + i
        expected = 2.0 * sum(values + 10 * r for r in range(n)) / n
        assert out.dtype == tensors[i].dtype and torch.equal(out.cpu().double(), expected.to(out.dtype).double()), i
    small = [torch.full((k,), hvd.rank() + k % 20, dtype=torch.int8, device=DEVICE)[1:] for k in range(2, 80)]
    for k, out in zip(range(2, 80), hvd.grouped_allreduce(small, op=hvd.Sum, name="fused.int8")):
        assert torch.equal(out.cpu(), torch.full((k - 1,), sum(r + k % 20 for r in range(n)), dtype=torch.int8)), k


def test_input_produced_by_a_running_kernel_is_waited_for():
    # The input is written by a kernel queued behind a 50 ms busy wait on the
    # current stream; the allreduce is enqueued at once, before it has run.
    x = torch.full((1 << 16,), -1000.0, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    x.fill_(hvd.rank() + 1)
    # The premise: a kernel's first launch in a process waits for the running
    # ones (CUDA loads its code then), and would hide the case; fill_ ran in
    # torch.full above.
    assert not torch.cuda.current_stream().query(), "the busy wait ended before the allreduce was enqueued"
    result = hvd.allreduce(x, op=hvd.Sum, name="ordering.input")
    total = sum(r + 1 for r in range(hvd.size()))
    assert torch.equal(result.cpu(), torch.full((1 << 16,), float(total)))


def test_result_is_used_on_the_stream_without_a_host_wait():
    handle = hvd.allreduce_async(rank_values(hvd.rank()), op=hvd.Sum, name="ordering.output")
    result = hvd.synchronize(handle)
    doubled = result * 2   # queued on the current stream, after the collective
    assert torch.equal(doubled.cpu().double(), 2 * expected_sum())


def test_on_a_side_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = rank_values(hvd.rank(), dtype=torch.float64)
        result = hvd.allreduce(x, op=hvd.Sum, name="side.stream")
        doubled = result * 2
    stream.synchronize()
    assert torch.equal(doubled.cpu(), 2 * expected_sum())


def test_ragged_allgather_and_alltoall_results_are_device_tensors():
    rows = hvd.rank() + 1
    x = torch.full((rows, 3), float(hvd.rank()), device=DEVICE)
    gathered = hvd.allgather(x, name="cuda.ragged")
    assert gathered.is_cuda and gathered.shape == (sum(r + 1 for r in range(hvd.size())), 3)
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(hvd.size())])
    assert torch.equal(gathered.cpu(), expected)
    n = hvd.size()
    splits = [(hvd.rank() + p) % 3 for p in range(n)]
    send = torch.cat([torch.full((splits[p],), float(100 * hvd.rank() + p), device=DEVICE) for p in range(n)])
    received, received_splits = hvd.alltoall(send, splits=splits, name="cuda.alltoall")
    assert received.is_cuda
    expected = torch.cat([torch.full(((q + hvd.rank()) % 3,), float(100 * q + hvd.rank())) for q in range(n)])
    assert torch.equal(received.cpu(), expected)
    assert received_splits.tolist() == [(q + hvd.rank()) % 3 for q in range(n)]


def test_a_host_pointer_given_as_device_memory_is_refused_and_the_process_goes_on():
    values = np.ones(4, np.float32)
    pointer = ffi.cast("void*", values.ctypes.data)
    with pytest.raises(unison.UnisonError, match="'host.as.device'.*the input is not device memory"):
        collective.enqueue(lib.UNISON_ALLREDUCE, "host.as.device", lib.UNISON_FLOAT32, (4,), pointer, pointer,
                           reduce_op=lib.UNISON_SUM, placement=(0, ffi.NULL))
    assert torch.equal(hvd.allreduce(torch.ones(2, device=DEVICE), op=hvd.Sum, name="after").cpu(),
                       torch.full((2,), float(hvd.size())))


# ---- training on the GPU against one process on the whole batch ------------------

ROWS = 4


def make_model(seed=7):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double().to(DEVICE)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    n = ROWS * hvd.size()
    return torch.randn(n, 6, generator=g).double().to(DEVICE), torch.randn(n, 3, generator=g).double().to(DEVICE)


def mine(t):
    return t[hvd.rank() * ROWS:(hvd.rank() + 1) * ROWS]


def reference(steps=4):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["DistributedOptimizer", "ZeroRedundancyOptimizer"])
def test_training_on_the_gpu_matches_one_process(kind):
    model = make_model(seed=7 + hvd.rank())   # different on every rank until broadcast
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if kind == "DistributedOptimizer":
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                             named_parameters=model.named_parameters())
    else:
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.05)
    for step in range(4):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(mine(x)), mine(y)).backward()
        optimizer.step()
    for got, want in zip(model.parameters(), reference()):
        assert got.is_cuda
        torch.testing.assert_close(got.detach().cpu(), want, rtol=1e-9, atol=1e-11)


def test_sync_batch_norm_on_the_gpu_matches_batch_norm_on_the_whole_batch():
    torch.manual_seed(3)
    everything = torch.randn(ROWS * hvd.size(), 5, dtype=torch.float64).to(DEVICE)
    sync = hvd.SyncBatchNorm(5).double().to(DEVICE)
    plain = torch.nn.BatchNorm1d(5).double().to(DEVICE)
    out = sync(mine(everything))
    want = mine(plain(everything))
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(sync.running_mean, plain.running_mean, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(sync.running_var, plain.running_var, rtol=1e-9, atol=1e-11)
