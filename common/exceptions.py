"""Errors raised by unison.

Everything unison raises is a UnisonError. Failures of a collective after it
was accepted (ranks disagreeing, a rank dying, a peer shutting down) are
UnisonInternalError, which is also importable as HorovodInternalError so
that code catching Horovod's error keeps working. Bad input caught before
anything is sent is InvalidArgumentError, also a ValueError; memory the core
could not allocate is OutOfMemoryError, also a MemoryError. An elastic
job's HostsUpdatedInterrupt is a signal, not an error: a RuntimeError, as
in Horovod, importable from here as from horovod.common.exceptions.
"""


class UnisonError(RuntimeError):
    """Base of every unison error."""


class InvalidArgumentError(UnisonError, ValueError):
    """The call was wrong on this rank alone (dtype, shape, root, name in flight...)."""


class NotInitializedError(InvalidArgumentError):
    """unison.init() has not been called, or shutdown() has."""


class UnsupportedError(InvalidArgumentError):
    """A valid request that this build or version cannot serve, or that a
    process forked from a rank makes for it (only the rank runs its ops)."""


class OutOfMemoryError(UnisonError, MemoryError):
    """The core could not allocate what a call needed (a result as large as
    the ranks' tensors add up to); nothing was written, and the process
    goes on. Also a MemoryError, so code that handles Python's own runs out
    of memory handles this too."""


class UnisonInternalError(UnisonError):
    """A collective failed after it was accepted."""


class MismatchError(UnisonInternalError):
    """Ranks submitted the same tensor name with different parameters."""


class RankFailedError(UnisonInternalError):
    """A peer rank died or stopped answering."""


class ShutDownError(UnisonInternalError):
    """A rank shut down while the op was pending."""


class StalledError(UnisonInternalError):
    """The stall inspector failed an op that some ranks never submitted."""


class DeadlockError(StalledError):
    """Every rank was blocked waiting on an op that another rank never
    submitted (a rank took another code path): none could ever run."""


HorovodInternalError = UnisonInternalError
"""Horovod's name for UnisonInternalError, the base of the errors of a collective that ranks
could not complete (MismatchError, RankFailedError, ShutDownError, StalledError), so that
`except HorovodInternalError`, elastic training's reset among them, catches them."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic jobs: hosts were added or removed, and the job re-forms at
    this commit (unison.elastic). skip_sync is True when hosts were only
    removed, so that every remaining rank already holds the committed state
    and no broadcast is needed. Here, beside HorovodInternalError, as in
    horovod.common.exceptions."""

    def __init__(self, skip_sync):
        super().__init__("unison: the job's hosts changed")
        self.skip_sync = skip_sync
