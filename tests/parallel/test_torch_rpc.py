"""unison.torch.rpc: torch's RPC, distributed autograd and remote
DistributedOptimizer inside a unison job, from one rank's point of view.
Rank 0 owns the remote parameters; the other ranks train."""
import glob
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as torch_rpc  # noqa: E402

import unison.torch as hvd  # noqa: E402
from unison.torch import rpc  # noqa: E402

torch.set_num_threads(1)


def test_rpc_before_init_rpc_is_a_clear_error():
    with pytest.raises(hvd.UnisonError, match="call unison.torch.rpc.init_rpc"):
        rpc.DistributedOptimizer(torch.optim.SGD, [], lr=0.1)


# What listened before RPC started: an MPI library's own sockets, under
# mpirun (tests/test_mpi.py runs this suite there too), are not RPC's.
_before_rpc = {}


@pytest.fixture(scope="module")
def rpc_job():
    _before_rpc.update(_listening_sockets())
    rpc.init_rpc()
    assert torch_rpc.get_worker_info().name == "worker%d" % hvd.rank()
    yield
    if rpc.is_initialized():
        rpc.shutdown()


def _listening_sockets():
    """{inode: address} of this process's listening TCP sockets, from the
    kernel's own tables (/proc/net/tcp and tcp6, matched by inode)."""
    import socket
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(fields[1].split(":")[0])
                # The kernel prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = socket.inet_ntop(family, words)
    return found


def test_rpc_listens_on_the_jobs_interface_only(rpc_job):
    """torch's RPC runs pickled Python for whoever connects, and checks no
    one: its store and TensorPipe listen only where the job's ranks meet,
    never on every address. One host: the loopback. Across hosts: the
    interface this rank reaches rank 0 through, and on rank 0 the store's
    rendezvous address (the host name's, on simulated hosts: 127.0.0.1
    here). What listened before init_rpc (MPI's own, under mpirun) is not
    RPC's."""
    from unison import network
    addresses = {address for inode, address in _listening_sockets().items() if inode not in _before_rpc}
    if hvd.cross_size() == 1:
        expected = {"127.0.0.1"}
    else:
        expected = {network.interface_address(os.environ["TP_SOCKET_IFNAME"])}
        if hvd.rank() == 0:
            expected.add(rpc._rendezvous_address())
    assert addresses and addresses <= expected and not addresses & {"0.0.0.0", "::"}, (addresses, expected)


def _cpu_ticks_by_thread():
    ticks = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:  # the thread ended meanwhile
            continue
        fields = rest.split()
        ticks[task] = (name.split("(", 1)[1], int(fields[11]) + int(fields[12]))  # utime + stime
    return ticks


def test_an_idle_rpc_agent_leaves_the_cores_to_training(rpc_job):
    # TensorPipe's shm transport polls without sleeping, a whole core per
    # rank (see rpc.DEFAULT_TRANSPORTS). Idle for a second, no thread of this
    # process may use a fifth of a core; a polling one uses nearly all of it.
    hvd.barrier()
    before = _cpu_ticks_by_thread()
    time.sleep(1.0)
    after = _cpu_ticks_by_thread()
    hz = os.sysconf("SC_CLK_TCK")
    busy = {name: (ticks - before[task][1]) / hz for task, (name, ticks) in after.items()
            if task in before and ticks - before[task][1] > 0.2 * hz}
    assert busy == {}, "threads busy while RPC idled (CPU seconds in 1 s): %r" % busy
    hvd.barrier()


# ---- on the owner (rank 0): parameters and a way to read them ----------------------

_owned = {}


def _make_parameter(key, values):
    _owned[key] = torch.tensor(values, requires_grad=True)
    return _owned[key]


def _value(key):
    return _owned[key].detach().clone()


_creating = threading.Lock()


def _embedding(key, rows, width, seed):
    """The one table under `key`: every trainer asks for it, and each gets
    an RRef to the same tensor."""
    with _creating:
        if key not in _owned:
            _owned[key] = torch.nn.Parameter(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))
        return _owned[key]


def _lookup(key, indices):
    return torch.nn.functional.embedding(indices, _owned[key])


def test_torch_docs_example_changes_remote_tensors_as_a_local_optimizer_would(rpc_job):
    # Two remote tensors on rank 0; rank 1 adds them into a loss, runs the
    # distributed backward and a step, then reads them back.
    if hvd.rank() == 1:
        a = torch_rpc.remote("worker0", _make_parameter, args=("a", [1.0, 2.0]))
        b = torch_rpc.remote("worker0", _make_parameter, args=("b", [3.0, -1.0]))
        optimizer = rpc.DistributedOptimizer(torch.optim.SGD, [a, b], lr=0.05)
        with dist_autograd.context() as context_id:
            x, y = a.to_here(), b.to_here()
            loss = (x * 3 + y * y).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        # The same step, locally.
        la, lb = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0, -1.0], requires_grad=True)
        local = torch.optim.SGD([la, lb], lr=0.05)
        (la * 3 + lb * lb).sum().backward()
        local.step()
        assert torch.equal(torch_rpc.rpc_sync("worker0", _value, args=("a",)), la.detach())
        assert torch.equal(torch_rpc.rpc_sync("worker0", _value, args=("b",)), lb.detach())
    hvd.barrier()


class _Tower(torch.nn.Module):
    """The trainers' dense part, replicated and kept in step by unison."""

    def __init__(self, width):
        super().__init__()
        torch.manual_seed(1)
        self.hidden = torch.nn.Linear(width, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def _batches(steps, batch):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 20, (batch, 4), generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def test_parameter_server_and_data_parallel_trainers_match_one_process(rpc_job):
    # Rank 0 holds a 20 x 6 embedding table; ranks 1.. are trainers, each
    # with its shard of every batch, averaging their dense tower through
    # unison within their process set. The owner applies each trainer's
    # step with lr / trainers, so a step of k trainers is one step on the
    # whole batch: after N steps everything equals one process trained on
    # the whole batches.
    n, me = hvd.size(), hvd.rank()
    trainers = hvd.add_process_set(list(range(1, n)))
    k, steps, lr = n - 1, 6, 0.1
    batches = _batches(steps, 4 * k)
    if me > 0:
        table = torch_rpc.remote("worker0", _embedding, args=("table", 20, 6, 7))
        tower = _Tower(6)
        optimizer = rpc.DistributedOptimizer(torch.optim.SGD, [table], lr=lr / k,
                                             dense_optimizer=torch.optim.SGD(tower.parameters(), lr=lr),
                                             process_set=trainers)
        for tokens, labels in batches:
            mine = slice((me - 1) * 4, me * 4)
            with dist_autograd.context() as context_id:
                rows = torch_rpc.rpc_sync("worker0", _lookup, args=("table", tokens[mine]))
                loss = torch.nn.functional.cross_entropy(tower(rows.mean(1)), labels[mine])
                dist_autograd.backward(context_id, [loss])
                # Every trainer's forward reads the table before any
                # trainer's step changes it.
                hvd.barrier(process_set=trainers)
                optimizer.step(context_id)
            hvd.barrier(process_set=trainers)
        # One process, the whole batches.
        ref_table = torch.nn.Parameter(torch.randn(20, 6, generator=torch.Generator().manual_seed(7)))
        ref_tower = _Tower(6)
        reference = torch.optim.SGD([ref_table] + list(ref_tower.parameters()), lr=lr)
        for tokens, labels in batches:
            reference.zero_grad()
            rows = torch.nn.functional.embedding(tokens, ref_table)
            torch.nn.functional.cross_entropy(ref_tower(rows.mean(1)), labels).backward()
            reference.step()
        remote_table = torch_rpc.rpc_sync("worker0", _value, args=("table",))
        torch.testing.assert_close(remote_table, ref_table.detach(), rtol=1e-5, atol=1e-6)
        for got, want in zip(tower.parameters(), ref_tower.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    hvd.barrier()
    hvd.remove_process_set(trainers)


class _ElsewhereRRef:
    """Stands in for an RRef from another job: its owner is no worker here."""

    def owner(self):
        return torch_rpc.WorkerInfo("worker99", 99)


def test_clear_errors(rpc_job):
    with pytest.raises(hvd.UnisonError, match=r"params_rref\[0\] is owned by worker99 \(id 99\), which is not a "
                                              r"worker of this job \(worker0, worker1"):
        rpc.DistributedOptimizer(torch.optim.SGD, [_ElsewhereRRef()], lr=0.1)
    with pytest.raises(hvd.UnisonError, match=r"params_rref\[0\] is a list, not an RRef"):
        rpc.DistributedOptimizer(torch.optim.SGD, [[1.0]], lr=0.1)
    mine = torch_rpc.RRef(torch.ones(2, requires_grad=True))
    optimizer = rpc.DistributedOptimizer(torch.optim.SGD, [mine], lr=0.1)
    with pytest.raises(hvd.UnisonError, match=r"step\(123456\): no distributed autograd context with that id"):
        optimizer.step(123456)
    with pytest.raises(hvd.UnisonError, match="already called"):
        rpc.init_rpc()
    hvd.barrier()


def test_hvd_shutdown_ends_rpc(rpc_job, monkeypatch):
    # The last test: it ends the RPC the module's fixture started.
    assert rpc.is_initialized()
    # No rank is through shutdown() before every rank is through torch's
    # (rank 0 hosts torch's store, which the others' shutdown still reads):
    # here the last rank takes a second longer over torch's, and every
    # rank waits for it.
    if hvd.rank() == hvd.size() - 1:
        torch_shutdown = torch_rpc.shutdown

        def slow_shutdown(*args, **kwargs):
            torch_shutdown(*args, **kwargs)
            time.sleep(1.0)
        monkeypatch.setattr(torch_rpc, "shutdown", slow_shutdown)
    started = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - started
    monkeypatch.undo()
    assert not rpc.is_initialized() and not hvd.is_initialized()
    assert took >= 0.9, took
    hvd.init()
    rpc.init_rpc()  # and it can start again
    assert torch_rpc.get_worker_info().name == "worker%d" % hvd.rank()
