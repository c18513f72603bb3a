"""unison.torch: Horovod's PyTorch API. `import unison.torch as hvd` in place
of `import horovod.torch as hvd` runs a Horovod training script unchanged."""
from unison.basics import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from unison.exceptions import HorovodInternalError, UnisonError  # noqa: F401
from unison.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from unison.torch.compression import Compression  # noqa: F401
from unison.torch.functions import (  # noqa: F401
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from unison.torch.ops import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce, allreduce_,
    allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
    broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
    sparse_allreduce_async, synchronize)
from unison.torch.optimizer import DistributedOptimizer  # noqa: F401
from unison.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from unison.torch.zero import ZeroRedundancyOptimizer  # noqa: F401
from unison.torch import elastic  # noqa: F401,E402  (hvd.elastic.run, hvd.elastic.TorchState...)
from unison.torch import mpi_ops  # noqa: F401,E402  (hvd.mpi_ops.<op>, as after import horovod.torch)
from unison.torch.compiled_code import keep_unison_out_of_compiled_graphs  # noqa: E402

# The public API: what the API reference documents and `import *` gives.
__all__ = [
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "HorovodInternalError", "UnisonError", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "Compression", "allgather_object", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "Adasum", "Average", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
    "sparse_allreduce_async", "synchronize", "DistributedOptimizer", "SyncBatchNorm",
    "ZeroRedundancyOptimizer", "elastic", "mpi_ops",
]

keep_unison_out_of_compiled_graphs()
