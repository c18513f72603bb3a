"""Horovod's module path horovod.torch.mpi_ops, for scripts that import
from it (`from horovod.torch.mpi_ops import allreduce_async_, Sum`): the
same names as unison.torch, so that only the package name changes."""
from unison.torch import *  # noqa: F401,F403
