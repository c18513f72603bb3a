"""Horovod's module path horovod.tensorflow.mpi_ops, for scripts that import
from it (`from horovod.tensorflow.mpi_ops import allreduce, Sum`): the
same names as unison.tensorflow, so that only the package name changes."""
from unison.tensorflow import *  # noqa: F401,F403
