"""Compiled extensions of the framework adapters, built against the
framework the user has installed.

A framework's C++ interface changes with its version and its build (torch's
C++ ABI, its headers' C++ standard), so an adapter's extension cannot ship
prebuilt. It is compiled on the user's machine the first time the adapter
is imported, and kept in a cache keyed by everything that went into it:
the source and unison.h, the compiler and every flag (which name the
framework's headers and libraries), the framework's version and Python's.
Later imports only load it; upgrading the framework makes a new entry.
At first import rather than at `pip install`: pip builds in an isolated
environment that has no framework, and the framework may change after
unison is installed.

The cache holds code that is loaded into the training process, so nothing
in it is trusted unless it and its folder belong to this user and nobody
else can write them; otherwise the adapter is told why and takes its
Python path. Ranks that start together build once: the first to take the
entry's lock builds it, the others wait and load what it built. A build
is written under a temporary name and renamed into place, so no process
ever loads half a library.
"""
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import warnings

from unison import core
from unison.exceptions import InvalidArgumentError, UnsupportedError

HEADERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")  # unison.h
_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
_BUILD_SECONDS = 900  # a compiler that takes longer is stuck, not slow

# The path each adapter's per-tensor work takes in this process, in words,
# by framework ("PyTorch": "compiled (...)"), for unisonrun --check-build.
ACTIVE = {}


class Unavailable(Exception):
    """Why an adapter's compiled extension cannot be used here."""


def compiled_or_fallback(label, setting_name, compiled, fallback, cost, build):
    """What build() returns ((value, "built" or "cached", the library's
    path)), or None where the adapter takes its fallback: chosen with
    `setting_name`=0, or because build() raised Unavailable, which is then
    warned about once, saying why and what the fallback costs (an error
    instead where `setting_name`=1). `compiled` names what was built for
    messages ("unison.torch's compiled path"), `fallback` the path taken
    without it; ACTIVE[label] says which is in use."""
    mode = auto_or_flag(setting_name)
    if mode == 0:
        ACTIVE[label] = "%s (%s=0)" % (fallback, setting_name)
        return None
    try:
        value, how, library = build()
    except Unavailable as e:
        if mode == 1:
            raise UnsupportedError("unison: %s=1, but %s cannot be used: %s" % (setting_name, compiled, e)) from None
        ACTIVE[label] = "%s: %s" % (fallback, e)
        warnings.warn("unison: %s cannot be used (%s); %s collectives take %s instead, %s. %s=0 chooses that "
                      "without this warning." % (compiled, e, label, fallback, cost, setting_name),
                      RuntimeWarning, stacklevel=3)
        return None
    ACTIVE[label] = "compiled (%s %s)" % (how, library)
    return value, how, library


def setting(name):
    """The environment's value of one of the adapters' settings, checked by
    the core's table (native/config.cc) as init would check it; None where
    it is not set."""
    value = os.environ.get(name)
    if value is None:
        return None
    problem = core.settings_problem({name: value})
    if problem is not None:
        raise InvalidArgumentError(problem)
    return value.strip()


def auto_or_flag(name):
    """An auto-or-flag setting: -1 for auto (or unset), else 1 or 0."""
    value = setting(name)
    if value is None or value.lower() == "auto":
        return -1
    return 1 if value.lower() in ("1", "true", "yes", "on") else 0


def cache_folder():
    """UNISON_CACHE_DIR, else $XDG_CACHE_HOME/unison, else ~/.cache/unison."""
    folder = setting("UNISON_CACHE_DIR")
    if not folder:
        folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                              "unison")
    return os.path.abspath(folder)


def _check_private(path, folder):
    """Raises Unavailable unless `path` is a folder (or a plain file), not
    a link, owned by this user and writable by no one else."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise Unavailable("cannot read %s: %s" % (path, e.strerror)) from None
    kind = "folder" if folder else "file"
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        raise Unavailable("%s is not a %s (a link, say); nothing there is loaded" % (path, kind))
    if st.st_uid != os.getuid():
        raise Unavailable("the %s %s belongs to user %d, not to this user (%d); nothing there is loaded"
                          % (kind, path, st.st_uid, os.getuid()))
    if st.st_mode & 0o022:
        raise Unavailable("the %s %s may be written by other users (mode %o); nothing there is loaded"
                          % (kind, path, stat.S_IMODE(st.st_mode)))


def _private_folder(path):
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise Unavailable("cannot create the cache folder %s: %s" % (path, e.strerror)) from None
    _check_private(path, folder=True)


def _import(module_name, path):
    _check_private(path, folder=False)
    loader = importlib.machinery.ExtensionFileLoader(module_name, path)
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        raise Unavailable("%s does not load: %s" % (path, e)) from None
    return module


def _compile(command, target, log):
    """Runs the compile `command` (which writes its library to `target`),
    keeping its output in `log` when it fails."""
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=_BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        raise Unavailable("the compiler ran for more than %d s" % _BUILD_SECONDS) from None
    except OSError as e:
        raise Unavailable("the compiler %s did not start: %s" % (command[0], e.strerror)) from None
    if done.returncode != 0:
        with open(log, "wb") as f:
            f.write(done.stdout)
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        errors = [line for line in lines if "error" in line] or lines[-3:]
        raise Unavailable("the build failed (exit status %d; its output is in %s): %s"
                          % (done.returncode, log, " | ".join(errors[:3])))
    if not os.path.exists(target):
        raise Unavailable("the compiler %s exited without writing %s" % (command[0], target))


def _local_headers(source):
    """The headers in `source`'s folder that it includes ("kernels_core.h")."""
    folder = os.path.dirname(source)
    with open(source, "rb") as f:
        included = re.findall(rb'^\s*#\s*include\s+"([^"/]+)"', f.read(), re.MULTILINE)
    return [os.path.join(folder, name.decode()) for name in included
            if os.path.isfile(os.path.join(folder, name.decode()))]


def cache_key(source, headers, compiler, flags, versions, framework_root):
    """What a build is cached under: the contents of `source`, of the
    headers beside it that it includes, and of unison.h (in `headers`),
    the compiler, Python, the flags and the framework's `versions`. Where
    unison and the framework are installed is left out (their files'
    contents are in the key), so that one build serves every virtual
    environment with the same framework."""
    key = hashlib.sha256()
    for path in [source] + _local_headers(source) + [os.path.join(headers, "unison.h")]:
        with open(path, "rb") as f:
            key.update(f.read())
    places = [(source, "<source>"), (headers, "<unison>"), (framework_root, "<framework>")]
    for part in [compiler, sys.version, _SUFFIX] + list(flags) + list(versions):
        for place, name in places:
            part = part.replace(place, name)
        key.update(b"\0" + part.encode())
    return key.hexdigest()[:24]


def build(stem, source, compile_flags, link_flags, versions, framework_root, suffix=_SUFFIX):
    """The library built from the C++ file `source` with $CXX (else g++)
    and the given flags, from the cache when a build with the same key is
    there. Returns (its path, "built" or "cached"); raises Unavailable,
    saying why, where it cannot be had.

    `framework_root` is the folder the framework is installed in, whose
    headers and libraries the flags name: it is left out of the key, as
    unison's own place is, so that virtual environments holding the same
    build of the framework share one library (CI's environments each have
    their own copy of the same torch), and `versions` must then say which
    build it is (version, commit, CUDA). The library is loaded after the
    framework, whose libraries it then finds already loaded, so it needs no
    path to them."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        raise Unavailable("no C++ compiler: %s is not on PATH (set CXX to one)" % (os.environ.get("CXX") or "g++"))
    python_headers = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(python_headers, "Python.h")):
        raise Unavailable("Python's headers are not installed (no Python.h in %s)" % python_headers)
    flags = (["-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-I" + HEADERS, "-I" + python_headers]
             + list(compile_flags) + [source] + list(link_flags))
    folder = os.path.join(cache_folder(), "extensions")
    _private_folder(os.path.dirname(folder))
    _private_folder(folder)
    entry = os.path.join(folder, "%s-%s" % (stem, cache_key(source, HEADERS, compiler, flags, versions,
                                                             framework_root)))
    library = entry + suffix
    if os.path.exists(library):
        _check_private(library, folder=False)
        return library, "cached"
    with open(os.open(entry + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it: wait, then load its build
        if os.path.exists(library):
            _check_private(library, folder=False)
            return library, "cached"
        handle, partial = tempfile.mkstemp(dir=folder, prefix=os.path.basename(entry) + ".", suffix=suffix)
        os.close(handle)
        try:
            _compile([compiler] + flags + ["-o", partial], partial, entry + ".log")
            os.chmod(partial, 0o700)
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library, "built"


def load(module_name, source, compile_flags, link_flags, versions, framework_root):
    """The Python extension `module_name` (its init function
    PyInit_<module_name>, in `source`), built as build() builds. Returns
    (module, "built" or "cached", the library's path)."""
    library, how = build(module_name, source, compile_flags, link_flags, versions, framework_root)
    return _import(module_name, library), how, library
