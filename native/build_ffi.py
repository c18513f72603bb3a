"""cffi builder for unison._native (API mode), used by setup.py.

The declarations come from native/unison.h itself (the block between
BEGIN CDEF and END CDEF), so the header stays the one description of the ABI.

The MPI backend (native/mpi/) is compiled when an `mpicc` is found (on PATH,
or named by $MPICC), with the flags that mpicc reports; otherwise
native/mpi/without_mpi.cc stands in for it. UNISON_WITH_MPI=1 makes a
missing MPI an error, UNISON_WITHOUT_MPI=1 leaves MPI out even if found.

UNISON_SANITIZE=address (AddressSanitizer with UndefinedBehaviorSanitizer)
or UNISON_SANITIZE=thread (ThreadSanitizer) builds an instrumented core for
tests/sanitized_suites.py (the `asan` and `tsan` tox envs); the process that
loads it needs the sanitizer's runtime preloaded.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STUB = os.path.join(HERE, "mpi", "without_mpi.cc")


def _cdef():
    with open(os.path.join(HERE, "unison.h")) as f:
        text = f.read()
    block = text.split("/* BEGIN CDEF */")[1].split("/* END CDEF */")[0]
    # cffi wants integer constants written as `#define NAME value` only.
    return re.sub(r"#define (\w+) (-?\d+)", r"#define \1 \2", block)


def _find_mpicc():
    if os.environ.get("UNISON_WITHOUT_MPI") == "1":
        return None
    candidates = [os.environ.get("MPICC"), shutil.which("mpicc"),
                  os.path.join(os.path.dirname(sys.executable), "mpicc")]
    for mpicc in candidates:
        if mpicc and os.access(mpicc, os.X_OK):
            return mpicc
    if os.environ.get("UNISON_WITH_MPI") == "1":
        sys.exit("unison: UNISON_WITH_MPI=1 but no mpicc was found on PATH or in $MPICC; "
                 "install an MPI (pip install mpich, or apt install libopenmpi-dev) first")
    return None


def _mpi_flags(mpicc):
    """include_dirs, library_dirs, libraries and link args from the wrapper:
    MPICH answers -show, Open MPI --showme."""
    for option in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicc, option], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 check=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        flags = {"include_dirs": [], "library_dirs": [], "libraries": [], "extra_link_args": []}
        for token in shlex.split(out)[1:]:
            if token.startswith("-I"):
                flags["include_dirs"].append(token[2:])
            elif token.startswith("-L"):
                flags["library_dirs"].append(token[2:])
            elif token.startswith("-l"):
                flags["libraries"].append(token[2:])
            elif token.startswith("-Wl,") or token == "-pthread":
                flags["extra_link_args"].append(token)
        if flags["libraries"]:
            return flags
    sys.exit("unison: %s answers neither -show nor --showme; set UNISON_WITHOUT_MPI=1 to build without MPI" % mpicc)


def _sources(with_mpi):
    files = sorted(glob.glob(os.path.join(HERE, "*.cc")) + glob.glob(os.path.join(HERE, "*", "*.cc")))
    mpi_folder = os.path.join(HERE, "mpi") + os.sep
    if with_mpi:
        files = [f for f in files if f != STUB]
    else:
        files = [f for f in files if not f.startswith(mpi_folder) or f == STUB]
    # Paths relative to the project root, where setup.py runs.
    return [os.path.relpath(f, ROOT) for f in files]


# What each UNISON_SANITIZE value adds to the compile and link lines.
# -fno-sanitize-recover: UndefinedBehaviorSanitizer's checks stop the
# process at their first report, as tests/sanitized_suites.py's
# halt_on_error asks of every sanitizer anyway; compiled that way, a check
# no longer keeps the code after it alive for a run that goes on. The
# AddressSanitizer core then compiled in 49 s instead of 64 s on a 2-core
# VM (engine.cc alone: 10 s instead of 18 s), with the same reports.
SANITIZERS = {"address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
              "thread": ["-fsanitize=thread"]}


def _sanitizer_flags():
    chosen = os.environ.get("UNISON_SANITIZE", "")
    if not chosen:
        return []
    if chosen not in SANITIZERS:
        sys.exit("unison: UNISON_SANITIZE=%r is not one of %s" % (chosen, ", ".join(sorted(SANITIZERS))))
    print("unison: building the core with %s" % " ".join(SANITIZERS[chosen]))
    # Frames kept and line tables in, so reports name the core's lines and
    # the functions inlined into them. -g1 gives exactly that; the full -g
    # (Python's CFLAGS carry it; the last -g option counts) adds the types
    # and variables, which only a debugger reads, and made the
    # AddressSanitizer core twice as slow to compile (engine.cc: 31 s
    # against 16 s on this 2-core VM), in every asan run from a clean cache.
    return SANITIZERS[chosen] + ["-fno-omit-frame-pointer", "-g1"]


SANITIZE = _sanitizer_flags()
# -O1 under a sanitizer, as their documentation advises. On a 2-core machine
# the AddressSanitizer core compiles in 90 s against -O3's 170 s (the
# ThreadSanitizer one in 27 s against 38 s), while the suites it runs take
# as long (183 s against 176 s; 317 s against 313 s); and fewer loads
# optimised away leave more for ThreadSanitizer to see.
OPTIMIZE = "-O1" if SANITIZE else "-O3"

MPICC = _find_mpicc()
MPI = _mpi_flags(MPICC) if MPICC else {"include_dirs": [], "library_dirs": [], "libraries": [], "extra_link_args": []}
if MPICC:
    print("unison: building the MPI backend with %s" % MPICC)
else:
    print("unison: no mpicc found; building without the MPI backend")

ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "unison._native",
    # The build's choice of MPI is written into the generated module source.
    # setuptools rebuilds an extension only when a source is newer than it,
    # and choosing MPI changes no source file, so without this line a build
    # with MPI after one without (a checkout whose build/ is left over) would
    # silently keep the MPI-less core. cffi rewrites the file when this text
    # changes, which makes it newer than the old extension.
    '#include "unison.h"\n/* unison core built with MPI: %s, sanitizers: %s */'
    % (MPICC or "no", " ".join(SANITIZE) or "none"),
    sources=_sources(MPICC is not None),
    # setuptools rebuilds when a source or one of these is newer than the
    # built core: an edit to a header alone must rebuild it too.
    depends=[os.path.relpath(f, ROOT) for f in sorted(glob.glob(os.path.join(HERE, "*.h")) +
                                                      glob.glob(os.path.join(HERE, "*", "*.h")))],
    include_dirs=[os.path.relpath(HERE, ROOT)] + MPI["include_dirs"],
    library_dirs=MPI["library_dirs"],
    source_extension=".cpp",
    # MPI's C++ bindings are not used: the core calls the C API.
    define_macros=[("MPICH_SKIP_MPICXX", "1"), ("OMPI_SKIP_MPICXX", "1")],
    extra_compile_args=["-std=c++17", OPTIMIZE, "-fvisibility=hidden", "-Wall"] + SANITIZE,
    extra_link_args=["-pthread"] + MPI["extra_link_args"] + SANITIZE,
    libraries=["rt"] + MPI["libraries"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
