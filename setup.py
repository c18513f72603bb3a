"""Builds unison: the pure-Python packages and the native core (unison._native).

The core needs only a C++17 compiler and the Python headers; every framework
adapter is an optional extra.
"""
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)  # cffi resolves the native sources relative to the project root

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
    packages=["unison", "unison.elastic", "unison.keras", "unison.torch", "unison.tensorflow",
              "unison.tensorflow.keras", "unison.mxnet"],
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy"],
    extras_require={
        "examples": ["scikit-learn"],
        # unisonrun --config-file in YAML, as horovodrun's (JSON needs nothing).
        "yaml": ["pyyaml"],
        "test": ["pytest", "pytest-timeout"],
        "bench": ["torch==2.13.0", "matplotlib", "ml_dtypes"],
        "torch": ["torch==2.13.0"],
        # MXNet 1.9.1 imports only with numpy up to 1.23.5.
        "mxnet": ["mxnet==1.9.1", "numpy==1.23.5"],
        # Keras 3 comes with it.
        "tensorflow": ["tensorflow-cpu==2.21.0"],
    },
    entry_points={"console_scripts": ["unisonrun = unison.run:main"]},
    zip_safe=False,
)
