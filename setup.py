"""Builds unison: the pure-Python packages and the native core (unison._native).

The core needs only a C++17 compiler and the Python headers; every framework
adapter is an optional extra.
"""
import atexit
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)  # cffi resolves the native sources relative to the project root


class ObjectCache:
    """Compiled objects kept by what went into them, so that a build whose
    source, flags and compiler match an earlier one's copies the object
    instead of compiling it. The key is the compile command (less the
    object's path), the compiler's version, and the source as the
    preprocessor sees it, every header included: an edited header, another
    MPI's mpi.h or a sanitizer's flags each make a new key, as with ccache.
    The folder a build runs in is left out (the sources are named relative
    to it, and the preprocessor is told not to write it), so a copy of the
    checkout elsewhere, as the MPI rebuild test makes, finds the same
    objects (that test: 63 s, then 5 s); they differ only in the compile
    folder their debug information records. The test suite builds the core six
    times (its package, each MPI env, the MPI rebuild test, twice) and all
    but the MPI files are the same each time: on a 2-core machine each full
    build took 80 s.

    The folder is $UNISON_BUILD_CACHE, or ~/.cache/unison/core-objects;
    UNISON_BUILD_CACHE="" turns the cache off."""

    KEPT = 400  # objects: a few builds' worth; the least recently used go first

    def __init__(self, folder):
        self.folder = folder
        self.versions = {}

    @classmethod
    def from_environment(cls):
        folder = os.environ.get("UNISON_BUILD_CACHE")
        if folder is None:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            folder = os.path.join(base, "unison", "core-objects")
        return cls(folder) if folder else None

    def _version(self, compiler):
        if compiler not in self.versions:
            self.versions[compiler] = subprocess.run([compiler, "--version"], stdout=subprocess.PIPE,
                                                     stderr=subprocess.DEVNULL).stdout
        return self.versions[compiler]

    def _key(self, command):
        """The key of a compile command (without its -o), or None where the
        source cannot be preprocessed (the compile itself then says why).
        The include folders are left out of the command's part: what they
        gave is in the preprocessed source, and each env's own include
        folder (every virtual environment adds one) would otherwise make
        every key differ between envs."""
        # -fno-working-directory: with -g, GCC writes the folder it runs in
        # into its preprocessed output, which would put it back in the key.
        preprocess = [("-E" if arg == "-c" else arg) for arg in command] + ["-fno-working-directory"]
        done = subprocess.run(preprocess, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if done.returncode != 0:
            return None
        flags = [arg for arg in command if not arg.startswith("-I")]
        digest = hashlib.sha256()
        for part in ("\0".join(flags).encode(), self._version(command[0]), done.stdout):
            digest.update(hashlib.sha256(part).digest())
        return digest.hexdigest()

    def wrap(self, compiler):
        """Makes `compiler` (a distutils CCompiler) compile through the
        cache. Its _compile(obj, src, ...) is the one step every version of
        setuptools takes per object; how it then runs the command (spawn or
        call) has changed between versions."""
        compile_one = compiler._compile

        def compile_through_cache(obj, src, ext, cc_args, extra_postargs, pp_opts):
            cxx = getattr(compiler, "compiler_so_cxx", None)
            program = cxx if cxx and compiler.detect_language(src) == "c++" else compiler.compiler_so
            key = self._key(list(program) + list(cc_args) + [src] + list(extra_postargs))
            cached = key and os.path.join(self.folder, key + ".o")
            if cached:
                try:
                    shutil.copyfile(cached, obj)
                    os.utime(cached)
                    return
                except FileNotFoundError:  # not there, or trimmed by a build beside this one
                    pass
            compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)
            if cached:
                os.makedirs(self.folder, exist_ok=True)
                # Written whole under another name, then renamed: a build
                # beside this one never copies half an object.
                fd, partial = tempfile.mkstemp(dir=self.folder, suffix=".partial")
                os.close(fd)
                shutil.copyfile(obj, partial)
                os.replace(partial, cached)
        compiler._compile = compile_through_cache
        return compile_one

    def trim(self):
        if not os.path.isdir(self.folder):
            return
        ages = []
        for entry in os.scandir(self.folder):
            try:
                if entry.name.endswith(".o"):
                    ages.append((entry.stat().st_mtime, entry.path))
            except FileNotFoundError:  # a build beside this one trimmed it first
                pass
        for _, path in sorted(ages, reverse=True)[self.KEPT:]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class BuildInAFolderOfItsOwn(build):
    """Builds in a fresh temporary folder, removed when the build ends,
    unless --build-base names one. Two builds in one checkout then never
    share objects: the test suite's environments run side by side
    (tox run-parallel), and the MPI and sanitizer envs each build the core
    while others test. A shared build/ would also let a build with other
    settings (another MPI, a sanitizer) pick up the last one's objects.
    What a rebuild would have reused comes from ObjectCache instead."""

    def finalize_options(self):
        if self.build_base == "build":  # the default, not one the caller chose
            self.build_base = tempfile.mkdtemp(prefix="unison-build-")
            atexit.register(shutil.rmtree, self.build_base, True)
        super().finalize_options()


class BuildExtInParallel(build_ext):
    """Compiles the core's sources in parallel, one job per usable core
    (`build_ext -j N` for N jobs). setuptools compiles an extension's
    sources one after another, and the core is some forty files: a serial
    build took 2.5 minutes on a 2-core machine, a parallel one 80 s, and CI
    builds the core several times (its package, each MPI env, and twice in
    the MPI rebuild test)."""

    def build_extension(self, ext):
        compile_serially = self.compiler.compile
        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 0 else len(os.sched_getaffinity(0))

        def compile_in_parallel(sources, output_dir=None, **options):
            if jobs < 2 or len(sources) < 2:
                return compile_serially(sources, output_dir=output_dir, **options)
            # Directories first, so that no two jobs race to create one.
            for obj in self.compiler.object_filenames(sources, output_dir=output_dir):
                os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
            # Largest first, so that the longest compile does not start last.
            order = sorted(range(len(sources)), key=lambda i: -os.path.getsize(sources[i]))
            with ThreadPoolExecutor(jobs) as pool:
                futures = {i: pool.submit(compile_serially, [sources[i]], output_dir=output_dir, **options)
                           for i in order}
                return [obj for i in range(len(sources)) for obj in futures[i].result()]

        self.compiler.compile = compile_in_parallel
        cache = ObjectCache.from_environment()
        compile_one = cache.wrap(self.compiler) if cache is not None else None
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_serially
            if cache is not None:
                self.compiler._compile = compile_one
                cache.trim()


setup(
    name="unison",
    version="0.1.0",
    description="Data-parallel training for PyTorch, TensorFlow/Keras and MXNet: the successor to Horovod",
    python_requires=">=3.9",
    package_dir={
        "unison": "common",
        "unison.torch": "torch_adapter",
        "unison.tensorflow": "tf_adapter",
        "unison.tensorflow.keras": "tf_adapter/keras",
        "unison.mxnet": "mxnet_adapter",
        "unison.lightning": "lightning_adapter",
        "unison.ray": "ray_adapter",
        "unison.spark": "spark_adapter",
    },
    packages=["unison", "unison.common", "unison.elastic", "unison.runner", "unison.keras", "unison.torch",
              "unison.tensorflow", "unison.tensorflow.keras", "unison.mxnet", "unison.lightning",
              "unison.ray", "unison.spark"],
    # What an adapter's extension is compiled from on the user's machine
    # (unison.adapter_extension): its source, and unison.h (a link to
    # native/unison.h, copied into the package as a file).
    package_data={"unison": ["include/unison.h"], "unison.torch": ["fast_path.cc"], "unison.tensorflow": ["kernels.cc", "kernels_core.h", "kernels_xla.cc"]},
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    cmdclass={"build": BuildInAFolderOfItsOwn, "build_ext": BuildExtInParallel},
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy"],
    extras_require={
        # unisonrun --config-file in YAML, as horovodrun's (JSON needs nothing).
        "yaml": ["pyyaml"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        "bench": ["torch==2.13.0", "matplotlib", "ml_dtypes"],
        # cloudpickle sends what has no importable name (lambdas, closures)
        # through broadcast_object and allgather_object, as in Horovod.
        "torch": ["torch==2.13.0", "cloudpickle"],
        # MXNet 1.9.1 imports only with numpy up to 1.23.5.
        "mxnet": ["mxnet==1.9.1", "numpy==1.23.5", "cloudpickle"],
        # Keras 3 comes with it.
        "tensorflow": ["tensorflow-cpu==2.21.0", "cloudpickle"],
        # unison.lightning's strategy, for Lightning 2.x.
        "lightning": ["torch==2.13.0", "lightning>=2.0", "cloudpickle"],
        # unison.ray: RayExecutor and Ray Train's UnisonTrainer (Ray Train V2).
        "ray": ["ray[train]>=2.50"],
        # unison.spark.run; Spark needs Java 17 or later besides.
        "spark": ["pyspark>=3.5", "cloudpickle"],
    },
    entry_points={"console_scripts": ["unisonrun = unison.runner.launch:main"]},
    zip_safe=False,
)
