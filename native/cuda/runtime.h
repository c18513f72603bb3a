// runtime.h: the CUDA runtime, found at run time.
//
// unison builds and imports with no CUDA anywhere: the runtime library is
// opened with dlopen the first time a device tensor arrives (or --check-build
// asks), and the few functions the core calls are declared here by hand.
// Their C signatures and the constants below are part of CUDA's stable ABI;
// the handles (streams, events) are the driver's own objects, so a stream
// that PyTorch made through its copy of the runtime is valid here too.
//
// Where a process already has a libcudart loaded (PyTorch's), that one is
// used, so both see one runtime; otherwise the loader's search path decides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../status.h"

namespace unison {

using cudaStream_t = void*;
using cudaEvent_t = void*;
using cudaError_t = int;

struct CudaRuntime {
  static constexpr int kMemcpyDefault = 4;         // cudaMemcpyDefault: direction from the pointers
  static constexpr unsigned kStreamNonBlocking = 1;
  static constexpr unsigned kEventDisableTiming = 2;
  static constexpr int kMemoryTypeDevice = 2;      // cudaMemoryTypeDevice
  static constexpr int kMemoryTypeManaged = 3;
  // cudaPointerAttributes: these four fields lead it since CUDA 11; later
  // releases append more, so room is left for them (CUDA 13's writes past
  // the four).
  struct PointerAttributes {
    int type;
    int device;
    void* device_pointer;
    void* host_pointer;
    char later_fields[512];
  };

  std::string library;  // the file it came from
  int version = 0;      // cudaRuntimeGetVersion: 13000 for 13.0
  int devices = 0;      // visible devices

  cudaError_t (*GetDeviceCount)(int*);
  cudaError_t (*GetDevice)(int*);
  cudaError_t (*SetDevice)(int);
  const char* (*GetErrorString)(cudaError_t);
  cudaError_t (*RuntimeGetVersion)(int*);
  cudaError_t (*DeviceGetPCIBusId)(char*, int, int);
  cudaError_t (*PointerGetAttributes)(PointerAttributes*, const void*);
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t*, unsigned);
  cudaError_t (*StreamDestroy)(cudaStream_t);
  cudaError_t (*StreamSynchronize)(cudaStream_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t*, unsigned);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventQuery)(cudaEvent_t);  // 0 once the work before it is done
  cudaError_t (*Malloc)(void**, size_t);
  cudaError_t (*Free)(void*);
  cudaError_t (*MallocHost)(void**, size_t);
  cudaError_t (*FreeHost)(void*);
  cudaError_t (*MemcpyAsync)(void*, const void*, size_t, int, cudaStream_t);
  cudaError_t (*MemsetAsync)(void*, int, size_t, cudaStream_t);
  // Kernels from PTX (device_kernels.h) go through the driver (libcuda.so.1,
  // installed with the driver itself), in the context the runtime made
  // current: its module API has been the same since CUDA 4.
  int (*ModuleLoadData)(void**, const void*);
  int (*ModuleGetFunction)(void**, void*, const char*);
  int (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, cudaStream_t,
                      void**, void**);

  // OK, or an error that names `what` and CUDA's own words.
  Status check(cudaError_t code, const std::string& what) const;
};

// The runtime, loaded once; null when it cannot be (see cuda_missing()).
const CudaRuntime* cuda_runtime();
// Why cuda_runtime() is null: no library found, or no device.
const std::string& cuda_missing();

// Events that mark how far a caller's stream had got when it enqueued an
// op. Creating one costs more than the op's bookkeeping, so they are kept
// for reuse, per device (an event belongs to the device it was made on).
// take_event needs `device` current; a null return means CUDA failed.
cudaEvent_t take_event(const CudaRuntime& cuda, int device);
void give_event(int device, cudaEvent_t event);

// Device memory the core hands to a caller as a result whose size only
// negotiation could tell; unison_free gives it back through
// free_device_result, which says false for memory that is not such.
Status allocate_device_result(const CudaRuntime& cuda, size_t bytes, void** out);
bool free_device_result(void* data);

// Makes `device` current on this thread for the life of the guard, and puts
// back the one that was: a framework's thread keeps its own current device.
class DeviceGuard {
 public:
  DeviceGuard(const CudaRuntime& cuda, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const CudaRuntime& cuda_;
  int previous_ = -1;
};

}  // namespace unison
