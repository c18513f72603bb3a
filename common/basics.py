"""The process-wide basics: init, shutdown, the timeline and the tuned
settings, over core.py's queries and errors, which it passes on: every
adapter imports all of these from here."""
import atexit
import os
import sys
import threading

from unison import elastic_worker, exceptions
from unison import process_sets as sets
from unison._native import ffi, lib
from unison.runner import torchrun
from unison.core import (  # noqa: F401  (passed on to the adapters)
    Adasum, Average, Max, Min, Product, Sum, backend_name, built_backends, ccl_built, check, cross_rank, cross_size,
    cuda_built, ddl_built, device_support, error_for, gloo_built, gloo_enabled, is_homogeneous, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    setting_table, settings_problem, size)
from unison.start_interrupt import interruptible_start

# A rank's identity (rank, size, job) is in its environment, and every
# process the rank starts inherits it. One that calls init() with it would
# try to join the job as a second copy of the rank, and the job would wait
# for the start timeout. So a rank of a job of several records in its
# environment which process it is (INITIALIZED_BY, "pid:rank"), and init()
# in any other process with that environment fails at once. The launchers
# drop the record from the environments they make (runner/launch.py).
INITIALIZED_BY = "UNISON_INITIALIZED_BY"
_initialized_in = None  # the pid that called init() with success; a forked child keeps its parent's


def _in_forked_child():
    """True in a process forked from a rank after its init(): a DataLoader
    worker, say. It has the rank's answers to rank() and size() but none of
    its threads, and no op of the rank's may run there (native/api.cc)."""
    return _initialized_in is not None and _initialized_in != os.getpid()


def _refuse_an_inherited_rank():
    pid, _, rank = os.environ.get(INITIALIZED_BY, "").partition(":")
    if pid and pid != str(os.getpid()):
        raise exceptions.UnsupportedError(
            "unison: init() in process %d, which inherited its environment from rank %s (process %s) of a "
            "running job, after that rank's init(): one rank runs in one process. A worker that the "
            "multiprocessing spawn or forkserver method started (a DataLoader's, say) re-runs the script's "
            "top level; call init() under `if __name__ == '__main__':` or use the fork method. To run this "
            "process as a job of its own, start it without the launcher's variables (UNISON_*, and MPI's under "
            "mpirun)." % (os.getpid(), rank, pid))


def init(comm=None, process_sets=None):
    """Starts unison in this process. Rank and size come from the launcher's
    environment; a process started on its own is rank 0 of 1.

    process_sets: ProcessSets (or rank lists) to register now, in order,
    as Horovod's static process sets; every rank passes the same list.
    comm: Horovod's communicator for the job, an mpi4py communicator or a
    list of ranks. unison runs on every rank its launcher started, so comm
    must be that whole job in rank order (MPI.COMM_WORLD under mpirun, or
    list(range(size()))); anything else fails this init, naming what
    differed, and leaves unison stopped, as before the call."""
    if _in_forked_child():
        return  # the rank's state came with the fork; init() again is harmless, as Horovod's
    _refuse_an_inherited_rank()
    started_here = not lib.unison_is_initialized()
    if started_here and torchrun.started_by_torchrun():
        torchrun.adopt()
    with interruptible_start():  # Ctrl-C ends the wait for the peers
        if elastic_worker.in_elastic_job() and started_here:
            _start_in_an_elastic_round()
        else:
            check(lib.unison_init())
    if comm is not None:
        problem = _communicator_problem(comm)
        if problem is not None:
            if started_here:
                lib.unison_shutdown()
            raise exceptions.UnsupportedError(problem)
    global _initialized_in
    _initialized_in = os.getpid()
    if size() > 1:  # a job of one shares nothing, so a copy of its identity harms nobody
        os.environ[INITIALIZED_BY] = "%d:%d" % (os.getpid(), rank())
    sets.register_at_init(process_sets)


# The elastic round whose start-up is in progress, and the lock that makes
# "is it still round N's?" and aborting it one step: a watch of an earlier
# round must not end a later round's start-up.
_start_lock = threading.Lock()
_starting_round = None


def _abort_start(number, why):
    with _start_lock:
        if _starting_round == number:
            lib.unison_abort_start(why.encode())


def _start_in_an_elastic_round():
    """Joins the elastic driver's next round and starts in it. A member of
    the round can die while it starts up (the core then fails at once,
    naming it): the round is lost, and the driver forms the next without
    that member's host. This worker joins that one, whether it is a
    newcomer in its first init() or a survivor in hvd.elastic.run's reset,
    rather than end, which would blacklist its host as well. join_round()
    ends the worker when the driver ends the job, and --reset-limit bounds
    the rounds."""
    global _starting_round
    while True:
        # This round's rank and size, from unisonrun's driver, and the port
        # this worker offered for the rendezvous, held until the core listens.
        elastic_worker.join_round().close()
        number = int(os.environ["UNISON_ELASTIC_ROUND"])
        with _start_lock:
            _starting_round = number
        # A member that dies before it reached this rank leaves nothing here
        # to notice: the driver, which saw it die, ends the start-up.
        elastic_worker.watch_round(_abort_start)
        try:
            code = lib.unison_init()
        finally:  # a KeyboardInterrupt (start_interrupt.py) leaves here too
            with _start_lock:
                _starting_round = None
        if code != lib.UNISON_ERR_RANK_FAILED:
            check(code)
            return
        print("unison: worker %s: round %s did not start: %s; joining the next" % (
            os.environ.get(elastic_worker.WORKER), number,
            ffi.string(lib.unison_last_error()).decode(errors="replace")), file=sys.stderr, flush=True)


def _communicator_problem(comm):
    """Why `comm` is not this whole job in rank order, or None when it is.
    Horovod runs on the ranks of any communicator, several jobs side by side
    in one MPI world; unison's ranks are the ones its launcher started, and
    a job on fewer ranks would disagree with the launcher about who is in
    it. Collectives among some ranks are process sets."""
    n, me = size(), rank()
    if hasattr(comm, "Get_group"):
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        if world.Get_size() != n or world.Get_rank() != me:
            return ("unison: init(comm=%r): this process is rank %d of %d in MPI.COMM_WORLD but rank %d of %d in "
                    "this job: the job was not started through mpirun (unisonrun --mpi), so no MPI communicator "
                    "spans it; call init() without comm" % (comm, world.Get_rank(), world.Get_size(), me, n))
        group = comm.Get_group()
        ranks = list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world.Get_group()))
        given = "a communicator of MPI.COMM_WORLD's ranks %s" % ranks
    else:
        try:
            ranks = [int(r) for r in comm]
        except (TypeError, ValueError):
            return "unison: init(comm=%r): give an mpi4py communicator or a list of ranks" % (comm,)
        given = "ranks %s" % ranks
    if ranks == list(range(n)):
        return None
    return ("unison: init(comm=...) names %s, but this job is ranks 0 to %d, the ones its launcher started, in "
            "that order, and unison runs on all of them: give the whole job (or no comm), and use process sets "
            "(add_process_set) for collectives among some ranks" % (given, n - 1))


# Called by shutdown() while unison still runs, for what was started on top
# of it and must end first (unison.torch.rpc's RPC, whose graceful end is a
# unison barrier).
before_shutdown = []


def shutdown():
    """Stops unison here and tells the other ranks. init() may follow."""
    if _in_forked_child():
        return  # the rank runs on in its own process: nothing here is this process's to stop
    for end in list(before_shutdown):
        end()
    lib.unison_shutdown()
    global _initialized_in
    _initialized_in = None
    sets.forget_all()


atexit.register(shutdown)


def start_timeline(file_path, mark_cycles=False):
    """Rank 0 writes a Chrome trace of every tensor's phases (queued,
    negotiating, the collective and its parts) to file_path, until
    stop_timeline() or shutdown(); open it in Perfetto or chrome://tracing,
    or summarise it with `python -m unison.timeline file_path`. Every rank
    calls it, as Horovod's does; only rank 0 writes. mark_cycles adds a
    marker at each negotiation cycle."""
    check(lib.unison_start_timeline(str(file_path).encode(), 1 if mark_cycles else 0))


def stop_timeline():
    """Ends the timeline file started by start_timeline() or UNISON_TIMELINE."""
    check(lib.unison_stop_timeline())


def tuned_settings():
    """The settings in force, the same on every rank: those configured, or
    the autotuner's (--autotune). `settled` is True once it has chosen."""
    fusion, cycle = ffi.new("int64_t*"), ffi.new("double*")
    cache, hierarchical, settled = ffi.new("int*"), ffi.new("int*"), ffi.new("int*")
    check(lib.unison_tuned_settings(fusion, cycle, cache, hierarchical, settled))
    return {"fusion_threshold_bytes": fusion[0], "cycle_time_ms": cycle[0], "cache": bool(cache[0]),
            "hierarchical": bool(hierarchical[0]), "settled": bool(settled[0])}
