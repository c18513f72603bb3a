"""The native core as every module above it sees it: the reduce ops, its
status codes turned into exceptions, its settings table, and its answers
to the rank, size and build queries. It knows nothing of init (basics.py)
or of process sets (process_sets.py), so both can build on it."""
import os

from unison import exceptions
from unison._native import ffi, lib

# Reduce operations, with Horovod's names.
Sum = lib.UNISON_SUM
"""The reduction `op=` that adds the ranks' tensors elementwise (for bool: any)."""
Average = lib.UNISON_AVERAGE
"""The reduction `op=` that adds the ranks' tensors and divides by the process set's size: the
default of every allreduce, as in Horovod."""
Min = lib.UNISON_MIN
"""The reduction `op=` that keeps the elementwise minimum over the ranks (for bool: all)."""
Max = lib.UNISON_MAX
"""The reduction `op=` that keeps the elementwise maximum over the ranks (for bool: any)."""
Product = lib.UNISON_PRODUCT
"""The reduction `op=` that multiplies the ranks' tensors elementwise (for bool: all)."""
Adasum = lib.UNISON_ADASUM  # native/adasum.h says what it computes
"""The reduction `op=` that combines floating-point gradients by how much they agree
(Adasum): orthogonal gradients add, equal ones average. Not for integers or reducescatter."""

_ERRORS = {
    lib.UNISON_ERR_INVALID_ARGUMENT: exceptions.InvalidArgumentError,
    lib.UNISON_ERR_NOT_INITIALIZED: exceptions.NotInitializedError,
    lib.UNISON_ERR_MISMATCH: exceptions.MismatchError,
    lib.UNISON_ERR_RANK_FAILED: exceptions.RankFailedError,
    lib.UNISON_ERR_SHUT_DOWN: exceptions.ShutDownError,
    lib.UNISON_ERR_STALLED: exceptions.StalledError,
    lib.UNISON_ERR_DEADLOCK: exceptions.DeadlockError,
    lib.UNISON_ERR_UNSUPPORTED: exceptions.UnsupportedError,
    lib.UNISON_ERR_INTERNAL: exceptions.UnisonInternalError,
    lib.UNISON_ERR_OUT_OF_MEMORY: exceptions.OutOfMemoryError,
}


def settings_problem(variables):
    """Why init() would refuse these environment variables (a dict of
    names to values), naming the setting and its value; None where it
    would take them."""
    names = [ffi.new("char[]", os.fsencode(name)) for name in variables]
    values = [ffi.new("char[]", os.fsencode(value)) for value in variables.values()]
    if lib.unison_check_settings(names, values, len(names)) == lib.UNISON_OK:
        return None
    return ffi.string(lib.unison_last_error()).decode(errors="replace")


def setting_table():
    """Every setting init() reads, as the core's table has it (config.cc):
    a list of dicts with name, horovod_name (or None), kind, minimum,
    maximum, choices (a list, or None), default, description, and the
    launcher's side: flag (unisonrun's option), flag_unit (what it takes
    where not the variable's unit, "MiB") and config_key (horovodrun's
    config file, "section.key"), each None where there is none. minimum
    and maximum bound the numeric kinds, and minimum is a secret's least
    length; both are None where they do not apply."""
    def text(pointer):
        return None if pointer == ffi.NULL else ffi.string(pointer).decode()

    numeric = ("integer", "bytes", "number", "core-list")
    rows = []
    while True:
        row = lib.unison_setting_at(len(rows))
        if row == ffi.NULL:
            return rows
        kind = text(row.kind)
        rows.append({"name": text(row.name), "horovod_name": text(row.horovod_name), "kind": kind,
                     "minimum": row.minimum if kind in numeric + ("secret",) else None,
                     "maximum": row.maximum if kind in numeric else None,
                     "choices": text(row.choices).split("|") if row.choices != ffi.NULL else None,
                     "default": text(row.default_value), "description": text(row.description),
                     "flag": text(row.flag), "flag_unit": text(row.flag_unit), "config_key": text(row.config_key)})


def error_for(code, message):
    return _ERRORS.get(code, exceptions.UnisonError)(message)


def check(code):
    """Raises the exception for a failed call's status code."""
    if code != lib.UNISON_OK:
        raise error_for(code, ffi.string(lib.unison_last_error()).decode(errors="replace"))


def is_initialized():
    """Whether init() has succeeded in this process and shutdown() has not been called since."""
    return bool(lib.unison_is_initialized())


def _query(function):
    out = ffi.new("int*")
    check(function(out))
    return out[0]


def rank():
    """This process's rank in the job, 0 to size() - 1. Raises NotInitializedError before init()."""
    return _query(lib.unison_rank)


def size():
    """How many ranks the job has. Raises NotInitializedError before init()."""
    return _query(lib.unison_size)


def local_rank():
    """This rank's place among the ranks on its host, 0 to local_size() - 1 (the usual
    choice of GPU). Raises NotInitializedError before init()."""
    return _query(lib.unison_local_rank)


def local_size():
    """How many of the job's ranks run on this host. Raises NotInitializedError before init()."""
    return _query(lib.unison_local_size)


def cross_rank():
    """This host's place among the hosts that run a rank with this local rank.
    Raises NotInitializedError before init()."""
    return _query(lib.unison_cross_rank)


def cross_size():
    """How many hosts run a rank with this local rank. Raises NotInitializedError before init()."""
    return _query(lib.unison_cross_size)


def is_homogeneous():
    """True when every host runs the same number of ranks (a job on one
    host always does)."""
    return bool(_query(lib.unison_is_homogeneous))


def backend_name():
    """The data plane in use: 'solo' (one rank), 'shm' (one host), 'hierarchical'
    (shared memory within hosts, MPI across) or 'mpi' (MPI between every pair)."""
    return ffi.string(lib.unison_backend_name()).decode()


def built_backends():
    """The data planes this build of the core holds, by name (for example ['shm', 'tcp', 'mpi'])."""
    return ffi.string(lib.unison_built_backends()).decode().split(",")


# Build queries, under Horovod's names.
def mpi_built():
    """Whether the core was built with its MPI data plane (Horovod's build query)."""
    return "mpi" in built_backends()


def gloo_built():
    """False: unison has no Gloo. Its TCP data plane does what Gloo does in Horovod, and
    `unisonrun --gloo` selects it (Horovod's build query)."""
    return False


def device_support():
    """Where GPU tensors can go, in words: the CUDA runtime and devices
    found, and NCCL. The core loads both at run time, so this is a fact
    about this machine and process, not about how unison was built."""
    return ffi.string(lib.unison_device_support()).decode()


def nccl_built():
    """Whether NCCL can be loaded: GPU collectives then go through it."""
    return "NCCL: not found" not in device_support()


def ddl_built():
    """False: IBM's DDL is not supported (Horovod's build query)."""
    return False


def ccl_built():
    """False: Intel's oneCCL is not supported (Horovod's build query)."""
    return False


def cuda_built():
    """Whether the CUDA runtime and a GPU were found: GPU tensors are taken."""
    return "CUDA: not found" not in device_support()


def rocm_built():
    """False: AMD GPUs are not supported (Horovod's build query)."""
    return False


def mpi_enabled():
    """Whether this job's ranks meet through MPI: it was started by mpirun
    or srun (or `unisonrun --mpi`) with more than one rank. False before
    init(), as in Horovod."""
    return is_initialized() and bool(_query(lib.unison_mpi_enabled))


def gloo_enabled():
    """False: unison has no Gloo (its TCP data plane runs where Horovod would use Gloo)."""
    return False


def mpi_threads_supported():
    """Whether the application may call MPI itself (mpi4py) from any thread
    beside unison: MPI is in use and runs at MPI_THREAD_MULTIPLE. Raises
    before init(), as Horovod does. Where MPI is not in use the answer is
    False; Horovod raises there instead, which would break a script moved
    from mpirun to unisonrun for a question whose answer is plain."""
    return bool(_query(lib.unison_mpi_threads_supported))
