// fake_cuda.cc: a stand-in for the CUDA runtime and the driver (and, in
// fake_nccl.cc, NCCL), so that the core's GPU path (native/cuda and
// native/nccl: events, streams, the host-staging plane, the NCCL planes)
// runs on machines with no GPU, CI's among them. tests/fake_cuda/__init__.py
// builds both files into libcudart.so.13, with libcuda.so.1 and
// libnccl.so.2 links to it (so the loader gives every name one copy, and
// one set of streams).
//
// It is faithful where the core's correctness depends on CUDA and nowhere
// else:
// - "Device memory" is host memory from cudaMalloc, and only that memory
//   is device memory to cudaPointerGetAttributes, so a host array passed
//   as a device tensor is refused as it would be on a GPU.
// - Each stream is a queue run in order by a thread of its own, later than
//   the call that queued the work. A copy, a memset or a kernel runs when
//   its stream reaches it; events mark a point in a stream; a stream that
//   waits for an event waits for that point. So an op that read its input
//   before the producer's stream got there, or a caller that read a result
//   before its stream was ordered after the collective, sees wrong values.
//   fake_cuda_delay() queues a pause, which makes such mistakes certain
//   rather than likely.
// - Kernels are looked up by name in the PTX image the core loads (a name
//   the image lacks is not found, as on a GPU) and run as the host code
//   below, which computes what device_kernels.cu computes.
// - NCCL calls (fake_nccl.cc) run on their stream too, and move bytes
//   between the ranks' processes through shared memory, with a GPU per
//   local rank where FAKE_CUDA_DEVICES gives several.
// What it cannot catch: the core touching device memory from the host
// outside a stream (here that memory is readable), and anything about
// speed.
#include <stdint.h>
#include <string.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda.h"

using namespace fake_cuda;

namespace {

constexpr int kInvalidValue = 1;
constexpr int kNotReady = 600;
constexpr int kNotFound = 500;
constexpr int kMemoryTypeUnregistered = 0, kMemoryTypeHost = 1, kMemoryTypeDevice = 2;

// The GPU machine's one, which its ranks share, unless FAKE_CUDA_DEVICES
// says more: then each local rank has a GPU of its own, and NCCL serves
// them all (a host of several GPUs).
int device_count() {
  static const int count = [] {
    const char* value = getenv("FAKE_CUDA_DEVICES");
    if (value == nullptr || *value == 0) return 1;
    char* end = nullptr;
    const long n = strtol(value, &end, 10);
    if (*end != 0 || n < 1 || n > 64) {
      fprintf(stderr, "fake CUDA: FAKE_CUDA_DEVICES=%s is not a count of devices from 1 to 64\n", value);
      abort();
    }
    return (int)n;
  }();
  return count;
}

// ---- streams and events (fake_cuda.h has the streams) ----------------------------

struct Event {
  Stream* stream = nullptr;  // where it was last recorded; null: never
  uint64_t position = 0;
};

std::mutex registry_mutex;
std::vector<Stream*> streams;  // every live stream, the default one first
thread_local int current_device = 0;

Stream* default_stream() {
  static Stream* s = [] {
    Stream* made = new Stream();  // lives as long as the process
    std::lock_guard<std::mutex> lock(registry_mutex);
    streams.insert(streams.begin(), made);
    return made;
  }();
  return s;
}

}  // namespace

Stream* fake_cuda::stream_of(void* handle) {
  return handle != nullptr ? static_cast<Stream*>(handle) : default_stream();
}

namespace {

void synchronize_all() {
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    all = streams;
  }
  for (Stream* s : all) s->synchronize();
}

// ---- memory ---------------------------------------------------------------------

struct Allocation {
  size_t bytes;
  int type;
  int device;
};
std::mutex memory_mutex;
std::map<uintptr_t, Allocation> allocations;  // by start address

void* allocate(size_t bytes, int type) {
  void* p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (p == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(memory_mutex);
  allocations[(uintptr_t)p] = {bytes, type, current_device};
  return p;
}

bool release(void* p, int type) {
  {
    std::lock_guard<std::mutex> lock(memory_mutex);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second.type != type) return false;
    allocations.erase(it);
  }
  free(p);
  return true;
}

const Allocation* find(const void* p) {
  auto it = allocations.upper_bound((uintptr_t)p);
  if (it == allocations.begin()) return nullptr;
  --it;
  const uintptr_t end = it->first + (it->second.bytes > 0 ? it->second.bytes : 1);
  return (uintptr_t)p < end ? &it->second : nullptr;
}

// ---- kernels: device_kernels.cu, on the host ------------------------------------

template <typename C>
C scaled(C v, double factor) {
  if constexpr (sizeof(C) == 4 && C(0.5) != C(0)) {
    return v * (float)factor;
  } else if constexpr (C(0.5) != C(0)) {
    return v * factor;
  } else {
    return (C)((double)v * factor);
  }
}

template <typename T>
void prescale(T* out, const T* in, uint64_t n, double factor) {
  using C = typename Codec<T>::Compute;
  for (uint64_t i = 0; i < n; ++i) out[i] = Codec<T>::store(scaled<C>(Codec<T>::load(in[i]), factor));
}

template <typename T>
void finish(T* data, uint64_t n, int ranks, double postscale) {
  using C = typename Codec<T>::Compute;
  const bool floating = C(0.5) != C(0);
  const bool by_reciprocal = floating && (ranks & (ranks - 1)) == 0;
  const C reciprocal = (C)1 / (C)ranks;
  for (uint64_t i = 0; i < n; ++i) {
    C v = Codec<T>::load(data[i]);
    if (ranks > 1) v = by_reciprocal ? v * reciprocal : v / (C)ranks;
    if (postscale != 1.0) v = scaled<C>(v, postscale);
    data[i] = Codec<T>::store(v);
  }
}

constexpr int kCopiesPerBatch = 64;
struct CopyBatch {
  const char* from[kCopiesPerBatch];
  char* to[kCopiesPerBatch];
  uint64_t bytes[kCopiesPerBatch];
};

// A kernel: what a launch's arguments become when the stream reaches it.
struct Kernel {
  std::string name;
  std::function<std::function<void()>(void** arguments, unsigned rows)> bind;
};

template <typename T>
void add_scale_kernels(std::vector<Kernel>* kernels, const std::string& suffix) {
  kernels->push_back({"unison_prescale_" + suffix, [](void** a, unsigned) -> std::function<void()> {
                        T* out = *static_cast<T**>(a[0]);
                        const T* in = *static_cast<const T**>(a[1]);
                        const uint64_t n = *static_cast<uint64_t*>(a[2]);
                        const double factor = *static_cast<double*>(a[3]);
                        return [=] { prescale<T>(out, in, n, factor); };
                      }});
  kernels->push_back({"unison_finish_" + suffix, [](void** a, unsigned) -> std::function<void()> {
                        T* data = *static_cast<T**>(a[0]);
                        const uint64_t n = *static_cast<uint64_t*>(a[1]);
                        const int ranks = *static_cast<int*>(a[2]);
                        const double postscale = *static_cast<double*>(a[3]);
                        return [=] { finish<T>(data, n, ranks, postscale); };
                      }});
}

const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> all = [] {
    std::vector<Kernel> k;
    k.push_back({"unison_batched_copy", [](void** a, unsigned rows) -> std::function<void()> {
                   const CopyBatch batch = *static_cast<CopyBatch*>(a[0]);  // by value, as a launch takes it
                   return [=] {
                     for (unsigned r = 0; r < rows; ++r) memmove(batch.to[r], batch.from[r], batch.bytes[r]);
                   };
                 }});
    add_scale_kernels<uint8_t>(&k, "uint8");
    add_scale_kernels<int8_t>(&k, "int8");
    add_scale_kernels<int16_t>(&k, "int16");
    add_scale_kernels<int32_t>(&k, "int32");
    add_scale_kernels<int64_t>(&k, "int64");
    add_scale_kernels<_Float16>(&k, "float16");
    add_scale_kernels<Bfloat16>(&k, "bfloat16");
    add_scale_kernels<float>(&k, "float32");
    add_scale_kernels<double>(&k, "float64");
    add_scale_kernels<uint16_t>(&k, "uint16");
    add_scale_kernels<uint32_t>(&k, "uint32");
    add_scale_kernels<uint64_t>(&k, "uint64");
    return k;
  }();
  return all;
}

}  // namespace

extern "C" {

// ---- the runtime ------------------------------------------------------------------

int cudaGetDeviceCount(int* count) {
  *count = device_count();
  return kSuccess;
}
int cudaGetDevice(int* device) {
  *device = current_device;
  return kSuccess;
}
int cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return kInvalidValue;
  current_device = device;
  return kSuccess;
}
const char* cudaGetErrorString(int code) {
  switch (code) {
    case kSuccess: return "no error (fake CUDA)";
    case kInvalidValue: return "invalid argument (fake CUDA)";
    case kNotReady: return "device not ready (fake CUDA)";
    default: return "an error (fake CUDA)";
  }
}
int cudaRuntimeGetVersion(int* version) {
  *version = 13000;
  return kSuccess;
}
int cudaDeviceGetPCIBusId(char* bus, int length, int device) {
  snprintf(bus, length, "0000:%02x:00.0", device + 1);
  return kSuccess;
}

struct PointerAttributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
};
int cudaPointerGetAttributes(PointerAttributes* a, const void* p) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  const Allocation* found = find(p);
  a->type = found != nullptr ? found->type : kMemoryTypeUnregistered;
  a->device = found != nullptr && found->type == kMemoryTypeDevice ? found->device : -2;
  a->device_pointer = found != nullptr && found->type == kMemoryTypeDevice ? const_cast<void*>(p) : nullptr;
  a->host_pointer = found != nullptr && found->type == kMemoryTypeHost ? const_cast<void*>(p) : nullptr;
  return kSuccess;
}

int cudaStreamCreateWithFlags(void** stream, unsigned) {
  default_stream();  // first, so that it leads the registry
  Stream* s = new Stream();
  std::lock_guard<std::mutex> lock(registry_mutex);
  streams.push_back(s);
  *stream = s;
  return kSuccess;
}
int cudaStreamDestroy(void* handle) {
  Stream* s = static_cast<Stream*>(handle);
  if (s == nullptr) return kInvalidValue;
  s->synchronize();  // CUDA lets queued work finish
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto it = streams.begin(); it != streams.end(); ++it)
      if (*it == s) {
        streams.erase(it);
        break;
      }
  }
  delete s;
  return kSuccess;
}
int cudaStreamSynchronize(void* stream) {
  stream_of(stream)->synchronize();
  return kSuccess;
}

int cudaEventCreateWithFlags(void** event, unsigned) {
  *event = new Event();
  return kSuccess;
}
int cudaEventDestroy(void* event) {
  delete static_cast<Event*>(event);
  return kSuccess;
}
int cudaEventRecord(void* event, void* stream) {
  Event* e = static_cast<Event*>(event);
  e->stream = stream_of(stream);
  e->position = e->stream->position();
  return kSuccess;
}
int cudaEventQuery(void* event) {
  const Event* e = static_cast<Event*>(event);
  return e->stream == nullptr || e->stream->reached(e->position) ? kSuccess : kNotReady;
}
int cudaStreamWaitEvent(void* stream, void* event, unsigned) {
  const Event e = *static_cast<Event*>(event);  // as recorded now; a later record does not move this wait
  if (e.stream != nullptr) stream_of(stream)->push([e] { e.stream->wait_until(e.position); });
  return kSuccess;
}

int cudaMalloc(void** p, size_t bytes) {
  *p = allocate(bytes, kMemoryTypeDevice);
  return *p != nullptr ? kSuccess : 2;  // cudaErrorMemoryAllocation
}
int cudaFree(void* p) {
  if (p == nullptr) return kSuccess;
  synchronize_all();  // cudaFree waits for the device's work
  return release(p, kMemoryTypeDevice) ? kSuccess : kInvalidValue;
}
// Stream-ordered, as a framework's caching allocator frees: nothing else
// waits, so a free never hides a missing order between streams.
int cudaFreeAsync(void* p, void* stream) {
  if (p == nullptr) return kSuccess;
  stream_of(stream)->push([p] { release(p, kMemoryTypeDevice); });
  return kSuccess;
}
int cudaMallocHost(void** p, size_t bytes) {
  *p = allocate(bytes, kMemoryTypeHost);
  return *p != nullptr ? kSuccess : 2;
}
int cudaFreeHost(void* p) {
  if (p == nullptr) return kSuccess;
  synchronize_all();
  return release(p, kMemoryTypeHost) ? kSuccess : kInvalidValue;
}
int cudaMemcpyAsync(void* to, const void* from, size_t bytes, int, void* stream) {
  stream_of(stream)->push([=] { device_work([=] { memmove(to, from, bytes); }); });
  return kSuccess;
}
int cudaMemsetAsync(void* to, int value, size_t bytes, void* stream) {
  stream_of(stream)->push([=] { device_work([=] { memset(to, value, bytes); }); });
  return kSuccess;
}

// ---- the driver -------------------------------------------------------------------

struct Module {
  std::string ptx;
};
int cuModuleLoadData(void** module, const void* image) {
  *module = new Module{static_cast<const char*>(image)};  // leaked, as the core never unloads it
  return kSuccess;
}
int cuModuleGetFunction(void** function, void* module, const char* name) {
  const std::string& ptx = static_cast<Module*>(module)->ptx;
  if (ptx.find(std::string(".entry ") + name + "(") == std::string::npos) return kNotFound;
  for (const Kernel& k : kernels())
    if (k.name == name) {
      *function = const_cast<Kernel*>(&k);
      return kSuccess;
    }
  return kNotFound;  // in the image but not here: this file is behind device_kernels.cu
}
int cuLaunchKernel(void* function, unsigned, unsigned rows, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void* stream, void** arguments, void**) {
  stream_of(stream)->push([work = static_cast<Kernel*>(function)->bind(arguments, rows)] { device_work(work); });
  return kSuccess;
}

// ---- for tests --------------------------------------------------------------------

// Queues a pause of `microseconds` on `stream`: a producer still running.
int fake_cuda_delay(void* stream, unsigned microseconds) {
  stream_of(stream)->push([=] { std::this_thread::sleep_for(std::chrono::microseconds(microseconds)); });
  return kSuccess;
}

// Whether this library is the fake: tests check before trusting it.
int fake_cuda_is_fake() { return 1; }

}  // extern "C"
