"""unison.mxnet: Horovod's MXNet API. `import unison.mxnet as hvd` in place
of `import horovod.mxnet as hvd` runs a Horovod MXNet/Gluon script."""
from unison.basics import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from unison.exceptions import HorovodInternalError, UnisonError  # noqa: F401
from unison.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from unison.mxnet.compression import Compression  # noqa: F401
from unison.mxnet.ops import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, allreduce_, alltoall, barrier,
    broadcast, broadcast_, grouped_allgather, grouped_allreduce, grouped_allreduce_, grouped_reducescatter,
    join, reducescatter)
from unison.mxnet.functions import (  # noqa: F401
    allgather_object, broadcast_object, broadcast_parameters)
from unison.mxnet.optimizer import DistributedOptimizer, DistributedTrainer  # noqa: F401
from unison.mxnet import elastic  # noqa: F401,E402  (hvd.elastic.run, hvd.elastic.MXNetState...)
from unison.mxnet import mpi_ops  # noqa: F401,E402  (hvd.mpi_ops.<op>, as after import horovod.mxnet)
from unison.common.util import split_list  # noqa: F401,E402  (horovod.mxnet exports it too)

# The public API: what the API reference documents and `import *` gives.
__all__ = [
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "HorovodInternalError", "UnisonError", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "Compression", "Adasum", "Average", "Max", "Min", "Product",
    "Sum", "allgather", "allreduce", "allreduce_", "alltoall", "barrier", "broadcast", "broadcast_",
    "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "join",
    "reducescatter", "allgather_object", "broadcast_object", "broadcast_parameters", "DistributedOptimizer",
    "DistributedTrainer", "elastic", "mpi_ops", "split_list",
]
