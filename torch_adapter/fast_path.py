"""unison.torch's compiled per-tensor path: fast_path.cc, built against
the installed torch by unison.adapter_extension (at first import, then
cached per torch version and flags).

It starts in-place allreduces, every gradient's op, in C++: about a
microsecond a tensor where the Python path takes three or more
(benchmarks/allreduce.py); and it is DistributedOptimizer's gradient hook
in its common case (benchmarks/gradient_hooks.py). It only repeats ops the Python path has checked
and started once (fast_path.cc says how), so both paths give the same
results and raise the same errors; the Python path stays for everything
else, and for the whole of a machine where the extension cannot be built,
with one warning that says why. UNISON_TORCH_FAST_PATH=0 chooses the
Python path without the warning; =1 makes a failed build an error.
"""
import os

import torch

from unison import adapter_extension, handles
from unison._native import ffi, lib

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_path.cc")
SETTING = "UNISON_TORCH_FAST_PATH"
LABEL = "PyTorch"


def _root():
    return os.path.dirname(os.path.abspath(torch.__file__))


def _flags():
    """(compile flags, link flags) for an extension of this torch: its
    headers and libraries, its C++ ABI, and the C++ standard its headers
    are written in."""
    root = _root()
    libraries = os.path.join(root, "lib")
    compile_flags = ["-std=c++20", "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI),
                     "-isystem", os.path.join(root, "include")]
    link_flags = ["-L" + libraries, "-lc10", "-ltorch_cpu", "-ltorch_python"]
    return compile_flags, link_flags


def _address(function):
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, function)))


def load():
    """The compiled module, bound to the core, or None for the Python path
    (which has then been warned about, unless chosen)."""
    def build():
        return adapter_extension.load(
            "unison_torch_fast_path", SOURCE, *_flags(),
            versions=[torch.__version__, str(torch.version.git_version), str(torch.version.cuda),
                      str(torch.version.hip)],
            framework_root=_root())
    built = adapter_extension.compiled_or_fallback(LABEL, SETTING, "unison.torch's compiled path", "the Python path",
                                                   "about 2 us more a tensor", build)
    if built is None:
        return None
    module = built[0]
    module.bind(_address("unison_enqueue"), _address("unison_wait_release"), handles.Handle, handles._in_flight,
                _address("unison_graph_node_begin"), _address("unison_graph_node_end"))
    handles.set_group_waiter(module.synchronize_many)
    return module
