#include "runtime.h"

#include <map>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "dynamic_library.h"

namespace unison {
namespace {

struct Loaded {
  CudaRuntime runtime;
  bool ok = false;
  std::string missing;
};

Loaded load() {
  Loaded loaded;
  CudaRuntime& c = loaded.runtime;
  static const char* const kRuntimes[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", nullptr};
  void* cudart = open_library(kRuntimes, &c.library);
  if (cudart == nullptr) {
    loaded.missing = "no CUDA runtime library (libcudart.so.13 or .12) could be opened";
    return loaded;
  }
  static const char* const kDrivers[] = {"libcuda.so.1", nullptr};
  std::string driver_name;
  void* driver = open_library(kDrivers, &driver_name);
  if (driver == nullptr) {
    loaded.missing = "the CUDA runtime is there (" + c.library + ") but the driver's libcuda.so.1 is not";
    return loaded;
  }
  std::string symbol;
  bind(cudart, "cudaGetDeviceCount", &c.GetDeviceCount, &symbol);
  bind(cudart, "cudaGetDevice", &c.GetDevice, &symbol);
  bind(cudart, "cudaSetDevice", &c.SetDevice, &symbol);
  bind(cudart, "cudaGetErrorString", &c.GetErrorString, &symbol);
  bind(cudart, "cudaRuntimeGetVersion", &c.RuntimeGetVersion, &symbol);
  bind(cudart, "cudaDeviceGetPCIBusId", &c.DeviceGetPCIBusId, &symbol);
  bind(cudart, "cudaPointerGetAttributes", &c.PointerGetAttributes, &symbol);
  bind(cudart, "cudaStreamCreateWithFlags", &c.StreamCreateWithFlags, &symbol);
  bind(cudart, "cudaStreamDestroy", &c.StreamDestroy, &symbol);
  bind(cudart, "cudaStreamSynchronize", &c.StreamSynchronize, &symbol);
  bind(cudart, "cudaStreamWaitEvent", &c.StreamWaitEvent, &symbol);
  bind(cudart, "cudaEventCreateWithFlags", &c.EventCreateWithFlags, &symbol);
  bind(cudart, "cudaEventDestroy", &c.EventDestroy, &symbol);
  bind(cudart, "cudaEventRecord", &c.EventRecord, &symbol);
  bind(cudart, "cudaEventQuery", &c.EventQuery, &symbol);
  bind(cudart, "cudaMalloc", &c.Malloc, &symbol);
  bind(cudart, "cudaFree", &c.Free, &symbol);
  bind(cudart, "cudaMallocHost", &c.MallocHost, &symbol);
  bind(cudart, "cudaFreeHost", &c.FreeHost, &symbol);
  bind(cudart, "cudaMemcpyAsync", &c.MemcpyAsync, &symbol);
  bind(cudart, "cudaMemsetAsync", &c.MemsetAsync, &symbol);
  bind(driver, "cuModuleLoadData", &c.ModuleLoadData, &symbol);
  bind(driver, "cuModuleGetFunction", &c.ModuleGetFunction, &symbol);
  bind(driver, "cuLaunchKernel", &c.LaunchKernel, &symbol);
  if (!symbol.empty()) {
    loaded.missing = c.library + " has no " + symbol;
    return loaded;
  }
  c.RuntimeGetVersion(&c.version);
  const cudaError_t counted = c.GetDeviceCount(&c.devices);
  if (counted != 0 || c.devices == 0) {
    loaded.missing = "CUDA (" + c.library + ") finds no device" +
                     (counted != 0 ? std::string(": ") + c.GetErrorString(counted) : std::string());
    return loaded;
  }
  loaded.ok = true;
  return loaded;
}

const Loaded& loaded() {
  static const Loaded once = load();
  return once;
}

}  // namespace

Status CudaRuntime::check(cudaError_t code, const std::string& what) const {
  if (code == 0) return Status::OK();
  return Status::Error(UNISON_ERR_INTERNAL, "unison: " + what + " failed: CUDA error " + std::to_string(code) +
                                                " (" + GetErrorString(code) + ")");
}

const CudaRuntime* cuda_runtime() { return loaded().ok ? &loaded().runtime : nullptr; }

const std::string& cuda_missing() { return loaded().missing; }

namespace {
std::mutex pool_mutex;
std::map<int, std::vector<cudaEvent_t>> spare_events;  // by device
std::unordered_set<void*> device_results;
}  // namespace

cudaEvent_t take_event(const CudaRuntime& cuda, int device) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    std::vector<cudaEvent_t>& spare = spare_events[device];
    if (!spare.empty()) {
      cudaEvent_t event = spare.back();
      spare.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  return cuda.EventCreateWithFlags(&event, CudaRuntime::kEventDisableTiming) == 0 ? event : nullptr;
}

void give_event(int device, cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  spare_events[device].push_back(event);
}

Status allocate_device_result(const CudaRuntime& cuda, size_t bytes, void** out) {
  Status s = cuda.check(cuda.Malloc(out, bytes > 0 ? bytes : 1), "allocating " + std::to_string(bytes) +
                                                                     " bytes of device memory for a result");
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(pool_mutex);
  device_results.insert(*out);
  return Status::OK();
}

bool free_device_result(void* data) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (device_results.erase(data) == 0) return false;
  }
  // cudaFree waits for the device's work, so no kernel still reads it.
  cuda_runtime()->Free(data);
  return true;
}

DeviceGuard::DeviceGuard(const CudaRuntime& cuda, int device) : cuda_(cuda) {
  if (cuda_.GetDevice(&previous_) != 0) previous_ = -1;
  if (previous_ != device) cuda_.SetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (previous_ >= 0 && cuda_.GetDevice(&now) == 0 && now != previous_) cuda_.SetDevice(previous_);
}

}  // namespace unison
