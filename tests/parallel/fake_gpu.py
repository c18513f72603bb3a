"""numpy arrays in the "device memory" of tests/fake_cuda (a CUDA runtime,
driver and NCCL that run on the host), and a unison.numpy whose arrays are on
that GPU: the shared grid runs through the core's GPU path with it on
machines that have no GPU (test_core_grid.py with UNISON_TEST_DEVICE=
fake-cuda; tests/test_parallel.py builds the library and says where it is
in UNISON_TEST_FAKE_CUDA).

Every array is written the way a GPU tensor is produced: by its stream,
after a pause (fake_cuda_delay), so an op that read its input before
waiting for the caller's stream would read what the memory held before. Results are read the
way a framework reads a GPU tensor: after the caller's stream has done
everything queued before, which includes the collective only if the core
ordered the stream after it."""
import ctypes
import importlib.util
import os

import numpy as np

import unison.numpy
from unison import frontend
from unison._native import ffi

_library = ctypes.CDLL(os.environ["UNISON_TEST_FAKE_CUDA"], mode=ctypes.RTLD_GLOBAL)
assert _library.fake_cuda_is_fake() == 1
_library.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
_library.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_library.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_void_p]
_library.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
_library.fake_cuda_delay.argtypes = [ctypes.c_void_p, ctypes.c_uint]

_MEMCPY_DEFAULT = 4
PRODUCER_DELAY_MICROSECONDS = 300

# GPU 0, which the ranks share; or, where the fake has a GPU for each local
# rank (FAKE_CUDA_DEVICES), the local rank's, as a torch user would pick
# with torch.cuda.set_device(hvd.local_rank()).
_count = ctypes.c_int()
assert _library.cudaGetDeviceCount(ctypes.byref(_count)) == 0
DEVICE = int(os.environ.get("UNISON_LOCAL_RANK", "0")) if _count.value > 1 else 0
assert _library.cudaSetDevice(DEVICE) == 0, "no fake GPU %d for this local rank" % DEVICE

# The caller's stream: what torch.cuda.current_stream() is to a torch user.
_stream = ctypes.c_void_p()
assert _library.cudaStreamCreateWithFlags(ctypes.byref(_stream), 1) == 0
STREAM = _stream.value
_in_transit = []  # host arrays the stream has yet to copy from


class _DeviceMemory:
    """cudaMalloc'd bytes, freed when the last array over them goes, in
    the caller's stream's order (cudaFree would wait for every stream,
    and so hide a result the core had not ordered the stream after)."""

    def __init__(self, nbytes):
        pointer = ctypes.c_void_p()
        assert _library.cudaMalloc(ctypes.byref(pointer), max(nbytes, 1)) == 0
        self.pointer = pointer.value
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.pointer, False),
                                    "version": 3}

    def __del__(self):
        _library.cudaFreeAsync(self.pointer, STREAM)


def synchronize():
    """Waits for everything queued on the caller's stream."""
    assert _library.cudaStreamSynchronize(STREAM) == 0
    del _in_transit[:]


class DeviceArray(np.ndarray):
    """An array in fake device memory. numpy reads and writes it on the
    host, so a host write first waits for the stream, as a framework's
    copy into a GPU tensor would be ordered on it."""

    def __setitem__(self, index, value):
        synchronize()
        super().__setitem__(index, value)


def empty(shape, dtype):
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.asarray(_DeviceMemory(count * dtype.itemsize))
    return raw[:count * dtype.itemsize].view(dtype).reshape(shape).view(DeviceArray)


def to_device(array):
    """`array`'s values in device memory, written by the caller's stream
    after a pause: a producer kernel still running when the op is enqueued."""
    host = np.array(array, order="C")  # ascontiguousarray would make a scalar 1-d
    device = empty(host.shape, host.dtype)
    if host.nbytes:
        _library.fake_cuda_delay(STREAM, PRODUCER_DELAY_MICROSECONDS)
        assert _library.cudaMemcpyAsync(device.ctypes.data, host.ctypes.data, host.nbytes, _MEMCPY_DEFAULT,
                                        STREAM) == 0
        _in_transit.append(host)
    return device


def to_host(array):
    """A host copy of a device array's values once the caller's stream has
    reached this point."""
    synchronize()
    return np.array(np.asarray(array))


class FakeGpuTensors(unison.numpy.NumpyTensors):
    """numpy arrays on fake GPU DEVICE, produced and consumed on STREAM."""
    _placement = (DEVICE, ffi.cast("void *", STREAM))

    def placement(self, array):
        return self._placement

    def empty_like(self, array):
        return empty(array.shape, array.dtype)

    def in_place(self, array, name):
        # Not NumpyTensors's shortcut, which says host memory.
        return frontend.Tensors.in_place(self, array, name)

    def adopt(self, owned, nbytes, shape, like):
        # The core's device result: host-readable here, freed by unison_free with the cdata.
        return super().adopt(owned, nbytes, shape, like).view(DeviceArray)


def _numpy_api_on_the_fake_gpu():
    """A second copy of unison.numpy whose front end puts arrays on the fake GPU."""
    spec = importlib.util.spec_from_file_location("unison_numpy_on_a_fake_gpu", unison.numpy.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.front_end = frontend.FrontEnd(FakeGpuTensors())
    return module


api = _numpy_api_on_the_fake_gpu()
