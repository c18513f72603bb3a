"""horovod.common.util's queries of what was built, which need no init().

Horovod asks each framework extension in a child process; unison has one
core for every framework, so the answers are the core's, and a framework is
available where it imports (`verbose` is accepted and changes nothing)."""
import importlib.util

from unison import basics
from unison.arguments import split_list  # noqa: F401  (also the optimizers' num_groups)

_FRAMEWORKS = {"torch": "torch", "tensorflow": "tensorflow", "mxnet": "mxnet"}


def _query(name):
    answer = getattr(basics, name)

    def built(verbose=False):
        return answer()
    built.__name__ = name
    built.__doc__ = "horovod.common.util.%s()" % name
    return built


mpi_built = _query("mpi_built")
gloo_built = _query("gloo_built")
nccl_built = _query("nccl_built")
ddl_built = _query("ddl_built")
ccl_built = _query("ccl_built")
cuda_built = _query("cuda_built")
rocm_built = _query("rocm_built")


def extension_available(ext_base_name, verbose=False):
    """Whether unison.<ext_base_name> can be used here: its framework imports."""
    framework = _FRAMEWORKS.get(ext_base_name)
    return framework is not None and importlib.util.find_spec(framework) is not None


# The front ends that take GPU tensors: unison.tensorflow and unison.mxnet
# move host memory only, and refuse a GPU tensor by name.
_TAKES_GPU_TENSORS = {"torch"}


def gpu_available(ext_base_name, verbose=False):
    """Whether unison.<ext_base_name> can take GPU tensors here: a script
    that asks before putting its tensors on a GPU gets the answer that
    keeps it running."""
    return (ext_base_name in _TAKES_GPU_TENSORS and extension_available(ext_base_name)
            and basics.cuda_built())


def num_rank_is_power_2(num_rank):
    return num_rank != 0 and num_rank & (num_rank - 1) == 0
