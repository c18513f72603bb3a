"""Horovod's module path horovod.mxnet.mpi_ops, for scripts that import
from it (`from horovod.mxnet.mpi_ops import allreduce_, Sum`): the
same names as unison.mxnet, so that only the package name changes."""
from unison.mxnet import *  # noqa: F401,F403
