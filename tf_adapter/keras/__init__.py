"""unison.tensorflow.keras (also importable as unison.keras): Horovod's
Keras API for the Keras 3 that comes with TensorFlow 2.21.
`import unison.tensorflow.keras as hvd` in place of
`import horovod.tensorflow.keras as hvd` (or `horovod.keras`)."""
import os as _os

import keras as _keras

# Keras 3 also runs on JAX and PyTorch (KERAS_BACKEND). Its optimizers and
# fit() then hold that backend's arrays, which the TensorFlow ops below
# cannot take: say so here rather than fail deep inside the first step.
if _keras.backend.backend() != "tensorflow":
    raise ImportError(
        "unison.keras runs Keras on its TensorFlow backend, but Keras is using %r (KERAS_BACKEND=%r): "
        "set KERAS_BACKEND=tensorflow, or train a PyTorch model with unison.torch"
        % (_keras.backend.backend(), _os.environ.get("KERAS_BACKEND", "")))
from unison.basics import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from unison.exceptions import HorovodInternalError, UnisonError  # noqa: F401
from unison.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from unison.tensorflow.compression import Compression  # noqa: F401
from unison.tensorflow.functions import allgather_object, broadcast_object  # noqa: F401
from unison.tensorflow.ops import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall, barrier, broadcast,
    grouped_allgather, grouped_allreduce, grouped_reducescatter, join, reducescatter)
from unison.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from unison.tensorflow.keras import callbacks, elastic  # noqa: F401
from unison.tensorflow.keras.optimizer import (  # noqa: F401
    DistributedOptimizer, PartialDistributedOptimizer, load_model)

# The public API: what the API reference documents and `import *` gives.
__all__ = [
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "HorovodInternalError", "UnisonError", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "Compression", "allgather_object", "broadcast_object",
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "alltoall", "barrier",
    "broadcast", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join", "reducescatter",
    "SyncBatchNormalization", "callbacks", "elastic", "DistributedOptimizer", "PartialDistributedOptimizer",
    "load_model", "broadcast_global_variables",
]


def broadcast_global_variables(root_rank, model=None):
    """Keras 3 keeps no global variable collection: pass the model, whose
    variables (and its optimizer's) are broadcast from root_rank."""
    if model is None:
        raise TypeError("unison: Keras 3 has no global variables; call broadcast_global_variables(root_rank, model)")
    from unison.tensorflow.functions import broadcast_variables
    variables = list(model.variables)
    if getattr(model, "optimizer", None) is not None:
        variables += list(model.optimizer.variables)
    return broadcast_variables(variables, root_rank)
