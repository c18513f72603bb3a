"""unison.ray: unison jobs on a Ray cluster, for the users of Horovod's
horovod.ray and of Ray Train's HorovodTrainer.

    from unison.ray import RayExecutor        # horovod.ray.RayExecutor
    from unison.ray import UnisonTrainer      # Ray Train (V2), where HorovodTrainer was

Ray schedules the workers (actors in a placement group, or Ray Train's
worker group); unison runs their collectives: shared memory among the
workers of a node, its TCP plane across nodes, with a secret made per job.
No ssh, MPI or launcher is involved. workers.py says how actors become
ranks, executor.py is RayExecutor, elastic.py its elastic jobs, train.py
the Ray Train integration.
"""
from unison.ray.executor import RayExecutor, RayExecutorSettings
from unison.ray.train import UnisonConfig, UnisonTrainer

__all__ = ["RayExecutor", "RayExecutorSettings", "UnisonConfig", "UnisonTrainer"]
