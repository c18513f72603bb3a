"""unison.mxnet.elastic (hvd.elastic): elastic training for MXNet Gluon.

    state = hvd.elastic.MXNetState(net.collect_params(), trainer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

Horovod has no MXNet elastic API; this one follows TorchState: the
parameters and the trainer's optimizer state are kept and restored
together, and a newcomer receives rank 0's. See unison.elastic for what
happens when a rank dies or hosts change.
"""
import copy

from unison import basics, elastic
from unison.elastic import HostsUpdatedInterrupt, State, run  # noqa: F401
from unison.mxnet.functions import broadcast_object, broadcast_parameters


class ObjectState(elastic.ObjectState):
    """Picklable values kept as attributes."""

    def __init__(self, bcast_object=broadcast_object, get_rank=basics.rank, **kwargs):
        super().__init__(bcast_object, get_rank, **kwargs)


class MXNetState(ObjectState):
    """Gluon parameters (a ParameterDict, or a dict of Parameters), the
    Trainer's optimizer state (momentum and the like, and its update
    counts), and picklable values, kept together."""

    def __init__(self, params, trainer=None, **kwargs):
        self.params = params
        self.trainer = trainer
        self._saved_params, self._saved_trainer = {}, None
        super().__init__(**kwargs)
        self.save()

    def _trainer_state(self):
        updater = self.trainer._updaters[0]
        optimizer = self.trainer._optimizer
        return (updater.get_states(dump_optimizer=False), optimizer.num_update,
                copy.deepcopy(optimizer._index_update_count))

    def _load_trainer_state(self, saved):
        states, num_update, counts = saved
        for updater in self.trainer._updaters:
            updater.set_states(states)
        self.trainer._optimizer.num_update = num_update
        self.trainer._optimizer._index_update_count = copy.deepcopy(counts)

    def save(self):
        self._saved_params = {name: p.data().copy() for name, p in sorted(self.params.items())
                              if p._data is not None}
        if self.trainer is not None:
            self._saved_trainer = self._trainer_state()
        super().save()

    def restore(self):
        for name, value in self._saved_params.items():
            self.params[name].set_data(value.copy())
        if self.trainer is not None:
            self._load_trainer_state(self._saved_trainer)
        super().restore()

    def sync(self):
        broadcast_parameters(self.params, root_rank=0, prefix="elastic.")
        if self.trainer is not None:
            self._load_trainer_state(broadcast_object(self._trainer_state(), 0, name="elastic.trainer"))
        super().sync()
        self.save()
