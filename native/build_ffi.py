"""cffi builder for unison._native (API mode), used by setup.py.

The declarations come from native/unison.h itself (the block between
BEGIN CDEF and END CDEF), so the header stays the one description of the ABI.
"""
import glob
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef():
    with open(os.path.join(HERE, "unison.h")) as f:
        text = f.read()
    block = text.split("/* BEGIN CDEF */")[1].split("/* END CDEF */")[0]
    # cffi wants integer constants written as `#define NAME value` only.
    return re.sub(r"#define (\w+) (-?\d+)", r"#define \1 \2", block)


def _sources():
    # Paths relative to the project root, where setup.py runs.
    files = sorted(glob.glob(os.path.join(HERE, "*.cc")) + glob.glob(os.path.join(HERE, "*", "*.cc")))
    root = os.path.dirname(HERE)
    return [os.path.relpath(f, root) for f in files]


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "unison._native",
    '#include "unison.h"',
    sources=_sources(),
    include_dirs=[os.path.relpath(HERE, os.path.dirname(HERE))],
    source_extension=".cpp",
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall"],
    extra_link_args=["-pthread"],
    libraries=["rt"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
