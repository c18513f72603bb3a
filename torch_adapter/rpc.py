"""unison.torch.rpc: torch's RPC (remote parameters, distributed autograd,
and a DistributedOptimizer like torch.distributed.optim's) inside a unison
job.

torch's RPC engine does the work; unison only arranges what a script would
otherwise have to: the rendezvous (rank 0 picks an address and a free port,
every rank learns them through unison, so a job started by unisonrun or
mpirun needs no MASTER_ADDR/MASTER_PORT), the worker names, and a
DistributedOptimizer that can also keep dense, replicated parameters
data-parallel with unison's allreduce in the same step.

    import unison.torch as hvd
    from unison.torch import rpc

    hvd.init()
    rpc.init_rpc()                          # worker0, worker1, ...
    ...
    with torch.distributed.autograd.context() as context_id:
        torch.distributed.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    rpc.shutdown()
"""
import os
import socket
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as torch_rpc

from unison import basics, collective, network, objects
from unison.exceptions import InvalidArgumentError, UnisonError
from unison.process_sets import check_member, global_process_set
import unison.torch.ops as ops


def worker_name(rank):
    """The default name of rank `rank`'s RPC worker."""
    return "worker%d" % rank


def _rendezvous_address():
    """Where rank 0's RPC agent listens. One host: the loopback. Across
    hosts: UNISON_RPC_ADDRESS if set, else the address of the interface
    the job's ranks use (--network-interface), else the address rank 0's
    host name resolves to (what the other hosts would use to reach it)."""
    address = os.environ.get("UNISON_RPC_ADDRESS")
    if address:
        return address
    if basics.cross_size() == 1:
        return "127.0.0.1"
    interface = os.environ.get("UNISON_NETWORK_INTERFACE", "")
    if interface and interface != "0.0.0.0":
        return network.interface_address(interface)
    return socket.gethostbyname(socket.gethostname())


def _interface_of(address):
    """The name of this host's interface that has IPv4 `address`, or None."""
    for _, name in socket.if_nameindex():
        try:
            if network.interface_address(name) == address:
                return name
        except SystemExit:  # an interface with no IPv4 address
            continue
    return None


def _bind_tensorpipe(rendezvous):
    """Makes TensorPipe listen on one interface: the loopback on one host,
    else the one this rank reaches rank 0's rendezvous through. TensorPipe
    would otherwise listen on the address the host name resolves to, which
    may face a network the job never uses; and RPC runs pickled Python for
    whoever connects. TP_SOCKET_IFNAME of the user's own wins."""
    if "TP_SOCKET_IFNAME" in os.environ:
        return
    if basics.cross_size() == 1:
        os.environ["TP_SOCKET_IFNAME"] = _interface_of("127.0.0.1") or "lo"
        return
    host = rendezvous.split("://", 1)[1].rsplit(":", 1)[0]
    interface = _interface_of(network.route_source(host))
    if interface is not None:
        os.environ["TP_SOCKET_IFNAME"] = interface


# TensorPipe's transports carry its control messages and small payloads;
# larger tensors go on its channels, which this leaves to torch. torch's
# first choice within a host is the "shm" transport, whose reactor thread
# polls without ever sleeping: each rank burns a core for as long as RPC is
# up, idle or not (measured: 99.7% of a core). Data-parallel ranks want
# those cores. On the 2-core CI machine at 3 ranks, test_torch_rpc.py's
# docs example took 7 to 119 s with it (a module import inside it ran 100
# times slower), an engine thread's 1 ms sleep once lasted 3 s, and 3 runs
# of the suite in 42 failed: one past its 120 s test timeout, two when a
# rank went silent past the peer timeout (as one did in CI). With "uv"
# (libuv sockets, which sleep in epoll) the example takes 2 to 4 s and 20
# runs of the suite passed. The cost is a small call's latency, 560 us
# against 380 us here; a 4 MiB argument was faster (3.6 ms against 4.6
# ms), the reactor no longer taking a core. A caller who wants shm passes
# rpc_backend_options with _transports.
DEFAULT_TRANSPORTS = ("uv",)
"""The TensorPipe transports init_rpc() gives torch's RPC unless `rpc_backend_options` says
otherwise: TCP through libuv (the comment above says why not shared memory)."""


# Rank 0 binds the store's socket itself, on the rendezvous address only,
# and hands it to torch's TCPStore (master_listen_fd): the store would
# otherwise listen on every address of the host. Held from before the
# broadcast of the port until the store takes it, nobody can take the port
# meanwhile. The "unison://" rendezvous scheme is how init_rpc's
# rendezvous reaches that store.
_listening = {}


def _listen(address):
    """(endpoint, socket): a listening socket on `address` for rank 0's store."""
    sock = network.bind_a_port_nobody_takes_by_chance(address)
    sock.listen(128)
    return "unison://%s:%d" % (address, sock.getsockname()[1]), sock


def _unison_rendezvous(url, rank=None, world_size=None, **_ignored):
    from datetime import timedelta
    import torch.distributed as dist
    from urllib.parse import urlparse
    parsed = urlparse(url)  # torch adds ?rank=...&world_size=...
    address, port = parsed.hostname, parsed.port
    sock = _listening.pop("unison://%s:%d" % (address, port), None)
    # The store takes the socket over (it closes it when it ends).
    listen_fd = sock.detach() if sock is not None else None
    try:
        store = dist.TCPStore(address, port, world_size, is_master=listen_fd is not None,
                              timeout=timedelta(seconds=300), master_listen_fd=listen_fd)
    except BaseException:
        if listen_fd is not None:
            os.close(listen_fd)
        raise
    yield store, rank, world_size


def _register_rendezvous():
    import importlib
    # By name: torch.distributed's own `rendezvous` function hides the module.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    try:
        rendezvous.register_rendezvous_handler("unison", _unison_rendezvous)
    except RuntimeError:  # registered by an earlier init_rpc
        pass


def is_initialized():
    """Whether torch's RPC is running in this process (init_rpc() was called and
    shutdown() was not)."""
    return torch_rpc.is_available() and torch_rpc.api._is_current_rpc_agent_set()


def _require_rpc(what):
    if not is_initialized():
        raise UnisonError("unison: %s needs torch's RPC; call unison.torch.rpc.init_rpc() first (after hvd.init())"
                          % what)


def init_rpc(name=None, backend=None, rpc_backend_options=None):
    """Starts torch's RPC on every rank of the job, as worker `name`
    (worker{rank} by default), with unison's rank and size. Collective:
    every rank calls it. Options not given are torch's defaults, but for
    the transports (DEFAULT_TRANSPORTS, above); the rendezvous
    (init_method) is unison's unless the options name one."""
    if not basics.is_initialized():
        raise UnisonError("unison: init_rpc() needs unison itself first: call hvd.init()")
    if is_initialized():
        raise UnisonError("unison: init_rpc() was already called in this process; call shutdown() first")
    rank, size = basics.rank(), basics.size()
    _register_rendezvous()
    endpoint = None
    if rank == 0:
        endpoint, sock = _listen(_rendezvous_address())
        _listening[endpoint] = sock
    endpoint = objects.broadcast_object(endpoint, root_rank=0, name="unison.rpc.rendezvous")
    _bind_tensorpipe(endpoint)
    if rpc_backend_options is None:
        rpc_backend_options = torch_rpc.TensorPipeRpcBackendOptions(init_method=endpoint,
                                                                    _transports=list(DEFAULT_TRANSPORTS))
    elif getattr(rpc_backend_options, "init_method", None) in (None, "env://"):
        rpc_backend_options.init_method = endpoint
    try:
        torch_rpc.init_rpc(name or worker_name(rank), backend=backend, rank=rank, world_size=size,
                           rpc_backend_options=rpc_backend_options)
    finally:
        unused = _listening.pop(endpoint, None)  # the options named another rendezvous, or it failed
        if unused is not None:
            unused.close()
    if _end_with_unison not in basics.before_shutdown:
        basics.before_shutdown.append(_end_with_unison)


def _end_with_unison():
    """hvd.shutdown() ends the RPC that init_rpc() started, as Horovod users
    expect shutdown() to end the job's communication. Gracefully when every
    rank is there; at once when one is gone (the barrier fails fast)."""
    if not is_initialized():
        return
    try:
        shutdown()
    except UnisonError:
        if is_initialized():  # the first barrier failed; a failure of the last finds RPC ended
            torch_rpc.shutdown(graceful=False)


def shutdown(graceful=True):
    """Ends RPC on this rank. First a unison barrier: it returns when every
    rank has finished its RPC work, and fails fast, naming the rank, when
    one has died (torch's own graceful shutdown would wait for it until
    its RPC timeout). Gracefully, it also returns only when every rank is
    through torch's shutdown (below)."""
    _require_rpc("shutdown()")
    if not graceful:
        torch_rpc.shutdown(graceful=False)
        return
    collective.barrier(name="unison.rpc.shutdown")
    torch_rpc.shutdown(graceful=True)
    # torch's graceful shutdown ends with the ranks counting in through the
    # store that rank 0 hosts, and a rank can be through it while another
    # still waits for the store's answer. A rank 0 that went on to exit
    # took the store with it, and the other rank's shutdown failed
    # ("DistNetworkError: Failed to recv, got 0 bytes"; once in CI, under
    # mpirun). So no rank leaves before every rank is through.
    collective.barrier(name="unison.rpc.shutdown.done")


def _owner_check(params_rref):
    workers = {info.id: info.name for info in torch_rpc.api._get_current_rpc_agent().get_worker_infos()}
    for i, rref in enumerate(params_rref):
        if not callable(getattr(rref, "owner", None)):  # RRef's own type is not subclassable: duck-type it
            raise InvalidArgumentError("unison: DistributedOptimizer: params_rref[%d] is a %s, not an RRef"
                                       % (i, type(rref).__name__))
        owner = rref.owner()
        if workers.get(owner.id) != owner.name:
            raise InvalidArgumentError(
                "unison: DistributedOptimizer: params_rref[%d] is owned by %s (id %d), which is not a worker of "
                "this job (%s)" % (i, owner.name, owner.id, ", ".join(workers[k] for k in sorted(workers))))


# ---- on each owner: its part of a DistributedOptimizer ------------------------------
#
# Why not torch.distributed.optim.DistributedOptimizer itself. torch's
# documents that concurrent steps are serialised on each owner, and its
# Python path does hold a lock; but for the optimizers it has a TorchScript
# form of (SGD, Adam and most others), it runs the scripted step with no
# lock at all. Two trainers stepping the same table at once then race in
# its in-place update and lose part of one another's step: the
# parameter-server test saw 5 of 120 elements off by a step's size in about
# one run in 40. Here every owner's steps take one lock, whatever the
# optimizer, and a parameter this context did not reach gets no gradient
# (torch's Python path would reuse the one left from an earlier step).

_owner_step_lock = threading.Lock()


class _OwnerOptimizer:
    def __init__(self, optimizer_class, params_rref, args, kwargs):
        self.params = [rref.local_value() for rref in params_rref]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id):
        gradients = dist_autograd.get_gradients(context_id)
        with _owner_step_lock:
            for p in self.params:
                p.grad = gradients.get(p)
            self.optimizer.step()


def _new_owner_optimizer(optimizer_class, params_rref, args, kwargs):
    return torch_rpc.RRef(_OwnerOptimizer(optimizer_class, params_rref, args, kwargs))


def _owner_step(optimizer_rref, context_id):
    optimizer_rref.local_value().step(context_id)


def _wait_all(futures):
    """Every future's value, after all of them have finished; the first
    failure is raised then, so none is left running behind it."""
    values, failure = [], None
    for future in futures:
        try:
            values.append(future.wait())
        except Exception as e:  # noqa: BLE001 - re-raised below
            failure = failure or e
    if failure is not None:
        raise failure
    return values


class DistributedOptimizer:
    """torch.distributed.optim.DistributedOptimizer's behaviour over
    `params_rref`: an `optimizer_class(params, *args, **kwargs)` on each
    owner for its own parameters, all owners stepping at once through
    torch's RPC, each owner's steps serialised by its lock (see above), an
    owner's error re-raised here.

    The hybrid mode: `dense_optimizer`, a local torch optimizer over
    parameters every trainer holds a replica of, takes its step in the same
    step() with the gradients of this autograd context averaged by unison
    across `process_set` (the trainers), while the remote steps run."""

    def __init__(self, optimizer_class, params_rref, *args, dense_optimizer=None,
                 process_set=global_process_set, **kwargs):
        _require_rpc("DistributedOptimizer")
        params_rref = list(params_rref)
        _owner_check(params_rref)
        by_owner = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner().name, []).append(rref)
        self._remote = _wait_all([torch_rpc.rpc_async(owner, _new_owner_optimizer,
                                                      args=(optimizer_class, rrefs, args, kwargs))
                                  for owner, rrefs in by_owner.items()])
        self._dense = dense_optimizer
        self._process_set = process_set
        if dense_optimizer is not None:
            check_member(process_set, "DistributedOptimizer")
            self._dense_params = [p for group in dense_optimizer.param_groups for p in group["params"]]
            self._names = ["rpc.dense.%d" % i for i in range(len(self._dense_params))]

    def _gradients(self, context_id):
        try:
            return dist_autograd.get_gradients(context_id)
        except RuntimeError as e:
            raise UnisonError(
                "unison: DistributedOptimizer.step(%r): no distributed autograd context with that id is active "
                "on this rank; call step() inside `with torch.distributed.autograd.context() as context_id:`, "
                "after torch.distributed.autograd.backward(context_id, ...)" % (context_id,)) from e

    def step(self, context_id):
        """One step of every owner's optimizer on the gradients of
        `context_id`, and of the dense optimizer on the averaged ones."""
        _require_rpc("DistributedOptimizer.step")
        gradients = self._gradients(context_id)
        handle = None
        if self._dense is not None:
            # Parameters this context did not reach get zeros, so every
            # trainer enqueues the same tensors.
            grads = [gradients.get(p, torch.zeros_like(p)) for p in self._dense_params]
            handle = ops.grouped_allreduce_async(grads, name="rpc.dense", op=ops.Average,
                                                 process_set=self._process_set)
        try:
            _wait_all([torch_rpc.rpc_async(optimizer.owner(), _owner_step, args=(optimizer, context_id))
                       for optimizer in self._remote])
        finally:
            averaged = ops.synchronize(handle) if handle is not None else None
        if self._dense is not None:
            for p, g in zip(self._dense_params, averaged):
                p.grad = g
            self._dense.step()

    def zero_grad(self, set_to_none=True):
        """Only the dense optimizer keeps .grad; remote gradients live in
        their autograd context."""
        if self._dense is not None:
            self._dense.zero_grad(set_to_none=set_to_none)
