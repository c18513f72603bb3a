"""unison.tensorflow's compiled op kernels: kernels.cc, built against the
installed TensorFlow by unison.adapter_extension (at first import, then
cached per TensorFlow version and flags), and loaded with
tf.load_op_library.

Inside a tf.function or a TF1 graph, each collective is then one node of an
asynchronous kernel that enqueues into the core and returns, completing
from the core's callback: no TensorFlow thread waits while the ranks
negotiate, and a node costs what TensorFlow's own ops cost rather than a
tf.py_function's ~0.25 ms (benchmarks/tf_op_path.py). The py_function
nodes stay as the fallback, for the whole of a machine where the library
cannot be built, with one warning that says why. UNISON_TF_KERNELS=0
chooses them without the warning; =1 makes a failed build an error.
"""
import ctypes
import os

import tensorflow as tf

from unison import adapter_extension
from unison._native import ffi, lib

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cc")
XLA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_xla.cc")
SETTING = "UNISON_TF_KERNELS"
LABEL = "TensorFlow"
XLA_LABEL = "TensorFlow under XLA"

# The core's functions the kernels call, in the order unison_tf_bind takes them.
_BOUND = ["unison_enqueue", "unison_group_begin", "unison_group_end", "unison_on_done", "unison_handle_error",
          "unison_handle_result", "unison_handle_received_splits", "unison_handle_join_rank", "unison_release",
          "unison_last_error", "unison_wait"]


def _root():
    return os.path.dirname(os.path.abspath(tf.__file__))


def _flags():
    """(compile flags, link flags) for an op library of this TensorFlow, as
    TensorFlow itself says (its headers, C++ ABI and standard, and its
    framework library). Its headers warn of their own deprecations by the
    hundred: those are silenced, errors are not."""
    return list(tf.sysconfig.get_compile_flags()) + ["-Wno-deprecated-declarations"], \
        list(tf.sysconfig.get_link_flags())


def _xla_flags():
    """The kernels' flags, and what XLA's headers need beyond them: two
    libraries the wheel ships headers of under external/, and
    libtensorflow_cc, which holds XLA (and its FFI API)."""
    compile_flags, link_flags = _flags()
    include = tf.sysconfig.get_include()
    extra = ["-I" + os.path.join(include, "external", "highwayhash"),
             "-I" + os.path.join(include, "external", "farmhash_archive", "src")]
    return compile_flags + extra, link_flags + ["-l:libtensorflow_cc.so.2"]


def _versions():
    info = tf.sysconfig.get_build_info()
    return [tf.__version__, str(tf.version.GIT_VERSION), str(info.get("cuda_version")),
            str(info.get("cudnn_version"))]


def _address(function):
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, function)))


def load(find_waiter):
    """The kernels' op module (tf.load_op_library), bound to the core, or
    None for the py_function nodes (which has then been warned about,
    unless chosen). find_waiter(key) -> the Linux thread id waiting for the
    graph that `key` names, for the core's deadlock test (unison.h,
    unison_set_waiter_finder)."""
    def build():
        library, how = adapter_extension.build("unison_tf_kernels", SOURCE, *_flags(), versions=_versions(),
                                               framework_root=_root(), suffix=".so")
        try:
            return tf.load_op_library(library), how, library
        except (tf.errors.OpError, OSError) as e:
            raise adapter_extension.Unavailable("%s does not load: %s" % (library, e)) from None
    built = adapter_extension.compiled_or_fallback(
        LABEL, SETTING, "unison.tensorflow's compiled kernels", "tf.py_function nodes",
        "about 0.2 ms more a collective in a graph, and a TensorFlow thread held while each waits", build)
    if built is None:
        adapter_extension.ACTIVE[XLA_LABEL] = "collectives refused under XLA: allreduce lowers to it through the " \
                                              "compiled kernels"
        return None
    module, _, library = built
    ctypes.CDLL(library).unison_tf_bind(_bound_functions(), len(_BOUND))
    _set_waiter_finder(find_waiter)
    adapter_extension.ACTIVE[XLA_LABEL] = "not built yet: it is built when a collective is first traced under XLA"
    return module


def _bound_functions():
    return (ctypes.c_uint64 * len(_BOUND))(*[_address(f) for f in _BOUND])


# Why allreduce does not lower to XLA in this process ("" where it does),
# once it has been tried.
_xla_problem = None


def xla_problem():
    """"" where allreduce and grouped allreduce lower to XLA in this
    process, else why not, in words. The lowering (kernels_xla.cc) is a
    library of its own, loaded after the kernels' (it registers the XLA
    form of their UnisonAllreduce op) and built the first time a
    collective is traced under XLA, not at import: XLA's headers take a
    compiler as long again as the kernels, which a script that never
    compiles with XLA should not pay, and they may not build where
    TensorFlow's do (a wheel without them), which must cost the kernels
    nothing. It is cached as the kernels are. Call only with the kernels
    loaded."""
    global _xla_problem
    if _xla_problem is None:
        try:
            library, how = adapter_extension.build("unison_tf_xla", XLA_SOURCE, *_xla_flags(),
                                                   versions=_versions(), framework_root=_root(), suffix=".so")
            try:
                tf.load_op_library(library)
            except (tf.errors.OpError, OSError) as e:
                raise adapter_extension.Unavailable("%s does not load: %s" % (library, e)) from None
            if ctypes.CDLL(library).unison_tf_xla_bind(_bound_functions(), len(_BOUND)) != 0:
                raise adapter_extension.Unavailable("%s loaded, but XLA did not take its kernel" % library)
            _xla_problem = ""
            adapter_extension.ACTIVE[XLA_LABEL] = "compiled (%s %s): allreduce and grouped allreduce" % (how, library)
        except adapter_extension.Unavailable as e:
            _xla_problem = str(e)
            adapter_extension.ACTIVE[XLA_LABEL] = "collectives refused under XLA: %s" % e
    return _xla_problem


# The finder, as a C function: kept for the life of the process, since the
# core may call it at any time.
_finder = None


def _set_waiter_finder(find_waiter):
    global _finder

    def find(key):
        try:
            return int(find_waiter(key))
        except Exception:  # noqa: BLE001 - the core asks from its own thread: no answer is "not known"
            return 0
    _finder = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(find)
    lib.unison_set_waiter_finder(ffi.cast("unison_waiter_finder", ctypes.cast(_finder, ctypes.c_void_p).value))
