"""unison.tensorflow: Horovod's TensorFlow API on tensorflow 2.21.
`import unison.tensorflow as hvd` in place of `import horovod.tensorflow
as hvd` runs a Horovod TensorFlow 2 script, or a TF1 one through
tf.compat.v1 (a graph run by a Session); unison.tensorflow.keras (and
unison.keras) is the Keras side."""
from unison.basics import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from unison.common.util import gpu_available, split_list  # noqa: F401  (horovod.tensorflow exports them too)
from unison.exceptions import HorovodInternalError, UnisonError  # noqa: F401
from unison.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from unison.tensorflow.compression import Compression  # noqa: F401
from unison.tensorflow.ops import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall, barrier, broadcast,
    broadcast_, grouped_allgather, grouped_allreduce, grouped_reducescatter, join, local_rank_op,
    local_size_op, process_set_included_op, rank_op, reducescatter, size_op)
from unison.tensorflow.functions import (  # noqa: F401
    BroadcastGlobalVariablesHook, allgather_object, broadcast_global_variables, broadcast_object,
    broadcast_object_fn, broadcast_variables)
from unison.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from unison.tensorflow.optimizer import DistributedOptimizer  # noqa: F401
from unison.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from unison.tensorflow import elastic  # noqa: F401,E402  (hvd.elastic.run, hvd.elastic.TensorFlowKerasState...)
from unison.tensorflow import mpi_ops  # noqa: F401,E402  (hvd.mpi_ops.<op>, as after import horovod.tensorflow)

# The public API: what the API reference documents and `import *` gives.
__all__ = [
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "gpu_available", "split_list", "HorovodInternalError", "UnisonError", "ProcessSet",
    "add_process_set", "global_process_set", "remove_process_set", "Compression", "Adasum", "Average", "Max",
    "Min", "Product", "Sum", "allgather", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join", "local_rank_op",
    "local_size_op", "process_set_included_op", "rank_op", "reducescatter", "size_op",
    "BroadcastGlobalVariablesHook", "allgather_object", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "SyncBatchNormalization", "elastic", "mpi_ops",
]
