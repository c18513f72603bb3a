"""unison: data-parallel training for PyTorch, TensorFlow/Keras and MXNet.

This root package holds what every framework shares: init and the
rank/size queries, the op constants, and the errors. Collectives live in the
front ends: unison.numpy, unison.torch, unison.tensorflow, unison.mxnet.
"""
from unison.basics import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, backend_name, built_backends, ccl_built,
    cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline, tuned_settings)
from unison.exceptions import (  # noqa: F401
    HorovodInternalError, InvalidArgumentError, MismatchError, NotInitializedError, OutOfMemoryError,
    RankFailedError, ShutDownError, StalledError, DeadlockError, UnisonError, UnisonInternalError,
    UnsupportedError)
from unison.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)

from unison.runner.function import run  # noqa: F401  (Horovod's horovod.run: unison.run(func, num_proc=2))
from unison.version import VERSION as __version__  # noqa: F401

# The public API: what the API reference documents and `import *` gives.
__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "backend_name", "built_backends", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "tuned_settings", "HorovodInternalError", "InvalidArgumentError", "MismatchError",
    "NotInitializedError", "OutOfMemoryError", "RankFailedError", "ShutDownError", "StalledError",
    "DeadlockError", "UnisonError", "UnisonInternalError", "UnsupportedError", "ProcessSet",
    "add_process_set", "global_process_set", "remove_process_set", "run",
]
