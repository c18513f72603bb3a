"""Builds fake_cuda.cc and fake_nccl.cc (a CUDA runtime, driver and NCCL
that run on the host; fake_cuda.cc's header says what they check and what
they cannot) into a folder the loader can be pointed at with
LD_LIBRARY_PATH."""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["libcuda.so.1", "libnccl.so.2"]  # links to libcudart.so.13: one copy, one set of streams


def build(folder, nccl=True):
    """Compiles the fake into `folder`; returns the runtime's path. Without
    `nccl` the folder has CUDA but no libnccl.so.2, as a machine whose NCCL
    is not installed."""
    runtime = os.path.join(folder, "libcudart.so.13")
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-Wl,-soname,libcudart.so.13",
                    "-o", runtime, os.path.join(HERE, "fake_cuda.cc"), os.path.join(HERE, "fake_nccl.cc")],
                   check=True)
    for name in NAMES if nccl else NAMES[:1]:
        os.symlink("libcudart.so.13", os.path.join(folder, name))
    return runtime
