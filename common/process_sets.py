"""Process sets: the ranks a collective runs among.

As in Horovod: `ProcessSet(ranks)` describes a set; `init(process_sets=[...])`
registers sets at start-up (ids 1, 2, ... in list order), and
`add_process_set`/`remove_process_set` register and drop sets later. Both
are collective: every rank of the job calls them, in the same order, with
the same ranks, even the ranks outside the set. The core gives each set its
own negotiation among its members (native/engine.h), so sets with no rank
in common run at the same time.

Horovod refuses `add_process_set` unless the job started with
`init(process_sets="dynamic")`, because dynamic sets slow down its MPI
controller. Here they cost nothing, so sets can be added either way;
"dynamic" is accepted for scripts that pass it.
"""
from unison import core
from unison._native import ffi, lib
from unison.exceptions import InvalidArgumentError


class ProcessSet:
    """A set of ranks, by id once registered. `rank()` and `size()` answer
    for this set; `rank()` is -1 on a rank outside it."""

    def __init__(self, ranks_or_comm=None, process_set_id=None):
        self.process_set_id = process_set_id
        if ranks_or_comm is None:
            self.ranks = None  # the global set: every rank, however many
        elif hasattr(ranks_or_comm, "Get_group"):
            self.ranks = _ranks_of_communicator(ranks_or_comm)
        else:
            try:
                ranks = [int(r) for r in ranks_or_comm]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    "unison: a ProcessSet takes a list of ranks or an mpi4py communicator, got %r"
                    % (ranks_or_comm,)) from None
            if len(set(ranks)) != len(ranks):
                raise InvalidArgumentError("unison: ProcessSet ranks %r name a rank twice" % (ranks,))
            self.ranks = sorted(ranks)

    def _ranks(self):
        if self.process_set_id is None:
            raise InvalidArgumentError(
                "unison: %r is not registered: pass it to init(process_sets=[...]) or add_process_set()" % (self,))
        return list(range(core.size())) if self.ranks is None else self.ranks

    def size(self):
        """How many ranks the set has. Raises InvalidArgumentError if the set is not registered."""
        return len(self._ranks())

    def rank(self):
        """This rank's place in the set (0 to size() - 1), or -1 on a rank outside it. Raises
        InvalidArgumentError if the set is not registered."""
        ranks = self._ranks()
        me = core.rank()
        return ranks.index(me) if me in ranks else -1

    def included(self):
        """Whether this rank belongs to the set. Raises InvalidArgumentError if the set is not
        registered."""
        return core.rank() in self._ranks()

    def __repr__(self):
        return "ProcessSet(process_set_id=%r, ranks=%r)" % (
            self.process_set_id, "all" if self.ranks is None else self.ranks)


def _ranks_of_communicator(comm):
    # Horovod also takes an mpi4py communicator: its ranks, as ranks of
    # COMM_WORLD (which are unison's ranks under mpirun).
    from mpi4py import MPI
    group = comm.Get_group()
    return sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), MPI.COMM_WORLD.Get_group()))


global_process_set = ProcessSet(process_set_id=0)
"""The process set of every rank of the job (id 0): the default `process_set` of every call."""

_registered = {0: global_process_set}  # id -> the ProcessSet object, this session


def find(process_set_id):
    """The registered process set with this id."""
    try:
        return _registered[process_set_id]
    except KeyError:
        raise InvalidArgumentError("unison: process set %r does not exist (never added, or removed)"
                                   % (process_set_id,)) from None


def size_of(process_set):
    """The size of `process_set` (None means the global set)."""
    return core.size() if process_set is None else process_set.size()


def process_set_id(process_set):
    """The core's id for `process_set` (None means the global set)."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError("unison: process_set must be a ProcessSet, got %r" % (process_set,))
    if process_set.process_set_id is None:
        process_set._ranks()  # raises: not registered
    return process_set.process_set_id


def check_member(process_set, what):
    """Raises, naming `what`, unless this rank is in `process_set`: an
    optimizer or layer bound to a set it is not in could never sync."""
    if process_set is None or process_set.ranks is None:
        return
    if not process_set.included():
        raise InvalidArgumentError("unison: %s: rank %d is not in process set %s (ranks %s)"
                                   % (what, core.rank(), process_set.process_set_id, process_set.ranks))


def add_process_set(process_set):
    """Registers `process_set` (a ProcessSet or a list of ranks) on every
    rank and returns it with its id. Collective: every rank calls it, in the
    same order. A set with the same ranks as an existing one is refused."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise InvalidArgumentError("unison: the global process set exists already")
    if process_set.process_set_id is not None and _registered.get(process_set.process_set_id) is process_set:
        raise InvalidArgumentError("unison: %r is registered already" % (process_set,))
    ranks = ffi.new("int[]", process_set.ranks)
    out = ffi.new("int*")
    core.check(lib.unison_add_process_set(ranks, len(process_set.ranks), out))
    process_set.process_set_id = out[0]
    _registered[out[0]] = process_set
    return process_set


def remove_process_set(process_set):
    """Drops `process_set` on every rank (collective, like add_process_set).
    Ops still waiting in it fail. Returns True; the global set cannot be
    removed (InvalidArgumentError, a ValueError)."""
    set_id = process_set_id(process_set)
    if set_id == 0:
        raise InvalidArgumentError("unison: the global process set cannot be removed")
    core.check(lib.unison_remove_process_set(set_id))
    _registered.pop(set_id, None)
    process_set.process_set_id = None
    return True


def register_at_init(process_sets):
    """init(process_sets=...): a list of ProcessSets (or rank lists) to add,
    in order, or "dynamic"."""
    _registered.clear()
    _registered[0] = global_process_set
    if process_sets is None or isinstance(process_sets, str) and process_sets == "dynamic":
        return
    if isinstance(process_sets, str):
        raise InvalidArgumentError('unison: init(process_sets=%r): pass a list of ProcessSets, or "dynamic"'
                                   % (process_sets,))
    for item in process_sets:
        if isinstance(item, ProcessSet) and item.ranks is None:
            continue  # the global set, listed
        if isinstance(item, ProcessSet):
            item.process_set_id = None
        add_process_set(item)


def forget_all():
    """After shutdown: no set but the global one exists any more."""
    for set_id, process_set in list(_registered.items()):
        if set_id != 0:
            process_set.process_set_id = None
    _registered.clear()
    _registered[0] = global_process_set


