"""Builds unison: the pure-Python packages and the native core (unison._native).

The core needs only a C++17 compiler and the Python headers; every framework
adapter is an optional extra.
"""
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)  # cffi resolves the native sources relative to the project root


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
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_serially


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
    },
    packages=["unison", "unison.common", "unison.elastic", "unison.keras", "unison.torch", "unison.tensorflow",
              "unison.tensorflow.keras", "unison.mxnet"],
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtInParallel},
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy"],
    extras_require={
        "examples": ["scikit-learn"],
        # unisonrun --config-file in YAML, as horovodrun's (JSON needs nothing).
        "yaml": ["pyyaml"],
        "test": ["pytest", "pytest-timeout"],
        "bench": ["torch==2.13.0", "matplotlib", "ml_dtypes"],
        # cloudpickle sends what has no importable name (lambdas, closures)
        # through broadcast_object and allgather_object, as in Horovod.
        "torch": ["torch==2.13.0", "cloudpickle"],
        # MXNet 1.9.1 imports only with numpy up to 1.23.5.
        "mxnet": ["mxnet==1.9.1", "numpy==1.23.5", "cloudpickle"],
        # Keras 3 comes with it.
        "tensorflow": ["tensorflow-cpu==2.21.0", "cloudpickle"],
    },
    entry_points={"console_scripts": ["unisonrun = unison.run:main"]},
    zip_safe=False,
)
