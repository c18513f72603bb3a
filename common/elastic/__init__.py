"""Elastic training, shared by every front end: the `run` decorator and the
State objects that survive a lost rank or a change of hosts.

A training function decorated with `hvd.elastic.run` takes a State first.
The state is committed (copied aside) every few batches. When a collective
fails because a rank died (HorovodInternalError), every survivor restores
the last commit, shuts unison down and initialises it again, which joins
the next round of unisonrun's elastic driver (elastic_worker.py) with
whoever is left. When the driver says the hosts changed, `commit()` raises
HostsUpdatedInterrupt on every rank at the same commit, and the job
re-forms without rolling back. Either way, the function then runs again
from the state, broadcast from rank 0 (a survivor, since the driver gives
survivors the lowest ranks) to any newcomer.

The front ends (unison.torch.elastic, unison.tensorflow.elastic,
unison.keras.elastic, unison.mxnet.elastic) bind these to their own
broadcast of objects and add their framework's States.
"""
import copy
import functools

from unison import basics, elastic_worker, objects
from unison.exceptions import DeadlockError, HostsUpdatedInterrupt, MismatchError, UnisonInternalError  # noqa: F401


class State:
    """What a training function needs to resume. Subclasses say how to
    save, restore and sync their values."""

    def __init__(self, bcast_object=None, get_rank=None):
        # Front ends pass their own broadcast (torch's keeps tensors compact).
        self._bcast_object = bcast_object or objects.broadcast_object
        self._rank = get_rank or basics.rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called, without arguments, each time the job re-forms
        (after init, before sync): to rescale a learning rate with the new
        size, say."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state, then raises HostsUpdatedInterrupt if the hosts
        changed. Commit every few batches: a failure rolls back to here."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank alike when the driver
        reports changed hosts. Rank 0 asks the driver and broadcasts its
        answer, so that no rank goes on training while another re-forms."""
        if not elastic_worker.in_elastic_job():
            return
        news = elastic_worker.hosts_changed() if self._rank() == 0 else None
        news = self._bcast_object(news, 0, name="unison.elastic.hosts")
        if news is not None:
            raise HostsUpdatedInterrupt(skip_sync=news)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called after the job re-forms; most states have nothing to do."""


class ObjectState(State):
    """Picklable values kept as attributes: `state.epoch`, `state.batch`.

    save() keeps deep copies, so that changing a list or dict in place
    after a commit cannot change what a restore brings back."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0, name="unison.elastic.objects")
            self._set_attrs()


def reset():
    """Leaves the current round and joins the next one."""
    basics.shutdown()
    basics.init()


def run_fn(func, reset):
    """The `run` decorator over a front end's reset function."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        rejoin = False
        while True:
            try:
                # Re-forming is inside the try: a rank can die while the
                # next round starts up too, and the survivors then go on to
                # the round after it rather than end the job.
                if rejoin:
                    reset()
                    state.on_reset()
                    rejoin = False
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            except (MismatchError, DeadlockError):
                # Ranks disagreeing on a tensor, or waiting on tensors the
                # others never submit, is a bug in the program: rolling back
                # would only meet it again.
                raise
            except UnisonInternalError:
                if not elastic_worker.in_elastic_job():
                    raise  # a plain job: no launcher can form another round
                # A rank died or stopped answering: go back to the last
                # commit, which every survivor holds.
                state.restore()
                skip_sync = False
            rejoin = True

    return wrapper


def run(func):
    """`hvd.elastic.run`, for front ends that need nothing else on reset."""
    return run_fn(func, reset)
