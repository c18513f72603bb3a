"""Process sets: the ranks a collective runs among.

Only the global set (every rank, id 0) exists so far. The `process_set`
keyword is accepted everywhere Horovod accepts it, so scripts that pass
`hvd.global_process_set` run unchanged; anything else is refused clearly.
"""
from unison import basics
from unison.exceptions import UnsupportedError


class ProcessSet:
    """A set of ranks, by id. Rank and size queries answer for this set."""

    def __init__(self, ranks=None, process_set_id=None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = process_set_id

    def size(self):
        return basics.size() if self.ranks is None else len(self.ranks)

    def rank(self):
        return basics.rank() if self.ranks is None else self.ranks.index(basics.rank())

    def included(self):
        return self.ranks is None or basics.rank() in self.ranks

    def __repr__(self):
        return "ProcessSet(process_set_id=%r, ranks=%r)" % (
            self.process_set_id, "all" if self.ranks is None else self.ranks)


global_process_set = ProcessSet(process_set_id=0)


def find(process_set_id):
    """The process set with this id."""
    if process_set_id == 0:
        return global_process_set
    raise UnsupportedError("unison: only the global process set (id 0) exists so far; got id %r" % (process_set_id,))


def size_of(process_set):
    """The size of `process_set` (None means the global set)."""
    return basics.size() if process_set is None else process_set.size()


def process_set_id(process_set):
    """The core's id for `process_set` (None means the global set)."""
    if process_set is None or process_set is global_process_set:
        return 0
    if isinstance(process_set, ProcessSet) and process_set.process_set_id == 0:
        return 0
    raise UnsupportedError("unison: only the global process set exists so far; got %r" % (process_set,))


def add_process_set(process_set):
    raise UnsupportedError("unison: process sets other than the global one are not implemented yet")


def remove_process_set(process_set):
    raise UnsupportedError("unison: process sets other than the global one are not implemented yet")
