"""Ray Train with unison: where Ray Train's HorovodTrainer users go now that
Ray Train V2 refuses it.

    import ray.train
    from unison.ray import UnisonTrainer

    def train_loop(config):
        import unison.torch as hvd
        hvd.init()
        ...                                  # shard by hvd.rank(), as under unisonrun
        ray.train.report({"loss": loss})

    trainer = UnisonTrainer(train_loop, train_loop_config={"lr": 0.01},
                            scaling_config=ray.train.ScalingConfig(num_workers=4))
    result = trainer.fit()

Ray Train's extension point for a collective library is a BackendConfig,
whose Backend prepares the worker group before the training function runs
(as TorchConfig's sets up torch.distributed). UnisonConfig's gives each
worker the identity a unison rank gets from unisonrun (workers.py); unison's
rank is Ray Train's world rank, and its local rank Ray Train's local rank.
UnisonTrainer is Ray's DataParallelTrainer with that config, as
HorovodTrainer was with HorovodConfig: datasets, checkpoints, run_config and
Ray Train's own fault tolerance (FailureConfig restarts the whole group,
which then forms a new unison job) work as for any Ray trainer.
"""
import os
from dataclasses import dataclass
from typing import Optional

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from unison import network
from unison.ray import workers as ray_workers


@dataclass
class UnisonConfig(BackendConfig):
    """unison's backend for Ray Train. timeout_s: how long the ranks wait for
    each other at init(). nics: the network interface of the TCP plane
    across nodes (one name)."""
    timeout_s: float = 300
    """Seconds the ranks wait for each other at init()."""
    nics: Optional[object] = None
    """The network interface of the TCP plane across nodes (one name), or None."""

    @property
    def backend_cls(self):
        """The Ray Train backend that starts unison in every worker."""
        return _UnisonBackend

    def to_dict(self):
        """The settings as a dict, as Ray Train records a backend's configuration."""
        return {"timeout_s": self.timeout_s, "nics": self.nics}


def _place():
    place = ray_workers.this_place()
    place["gpus"] = []  # Ray Train shares the node's GPUs among its workers itself (share_cuda_visible_devices)
    return place


def _update_env(env):
    os.environ.update(env)


class _UnisonBackend(Backend):
    # Every worker of a node sees all the node's GPUs given to the group,
    # so that hvd.local_rank() names its own, as under unisonrun.
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config):
        places = worker_group.execute(_place)  # in world-rank order
        port = None
        if len({ray_workers.host_name(p) for p in places}) > 1:
            port = worker_group.execute_single(0, network.a_port_nobody_takes_by_chance, places[0]["address"])
        environments, job_id = ray_workers.job_environments(
            places, port, timeout_s=backend_config.timeout_s,
            network_interface=network.one_interface(backend_config.nics, "unison.ray.UnisonConfig"))
        self._job_id = job_id
        ray.get([worker_group.execute_single_async(i, _update_env, env) for i, env in enumerate(environments)])

    def on_shutdown(self, worker_group, backend_config):
        job_id = getattr(self, "_job_id", None)
        if job_id is not None:
            worker_group.execute(ray_workers.stop_here, job_id)


class UnisonTrainer(DataParallelTrainer):
    """A Ray Train trainer whose workers form a unison job: Ray's
    DataParallelTrainer with UnisonConfig (HorovodTrainer's arguments, with
    unison_config for horovod_config)."""

    def __init__(self, train_loop_per_worker, *, train_loop_config=None, unison_config=None, scaling_config=None,
                 run_config=None, datasets=None, dataset_config=None, **kwargs):
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=unison_config or UnisonConfig(), scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets, dataset_config=dataset_config, **kwargs)
