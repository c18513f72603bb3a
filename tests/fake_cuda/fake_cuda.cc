// fake_cuda.cc: a stand-in for the CUDA runtime, the driver and NCCL, so
// that the core's GPU path (native/cuda and native/nccl: events, streams,
// the host-staging plane, the NCCL plane's fusion and kernels) runs on
// machines with no GPU, CI's among them. tests/fake_cuda/__init__.py
// builds it as libcudart.so.13, with libcuda.so.1 and libnccl.so.2 links to
// the same file (so the loader gives every name one copy, and one set of
// streams).
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
// What it cannot catch: the core touching device memory from the host
// outside a stream (here that memory is readable), and anything about
// speed.
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotReady = 600;
constexpr int kNotFound = 500;
constexpr int kMemoryTypeUnregistered = 0, kMemoryTypeHost = 1, kMemoryTypeDevice = 2;

// Every copy, memset and kernel takes this long before it does anything:
// work queued on a GPU finishes well after the call that queued it, so a
// host that reads a result without the stream's say-so reads it early
// every time, not now and then.
constexpr auto kDeviceWorkTakes = std::chrono::microseconds(50);

void device_work(std::function<void()> work) {
  std::this_thread::sleep_for(kDeviceWorkTakes);
  work();
}

int device_count() { return 1; }  // the GPU machine's count; ranks on it share the one

// ---- streams and events ---------------------------------------------------------

class Stream {
 public:
  Stream() : worker_([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }

  // The position the work now queued will have reached once done.
  uint64_t push(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(work));
    changed_.notify_all();
    return ++queued_;
  }
  uint64_t position() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queued_;
  }
  bool reached(uint64_t position) {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ >= position;
  }
  void wait_until(uint64_t position) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_ >= position; });
  }
  void synchronize() { wait_until(position()); }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
      ++done_;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  uint64_t queued_ = 0, done_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

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

Stream* stream_of(void* handle) { return handle != nullptr ? static_cast<Stream*>(handle) : default_stream(); }

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

template <typename T>
struct Codec {
  using Compute = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
struct Bfloat16 {
  uint16_t bits;
};
template <>
struct Codec<_Float16> {
  using Compute = float;
  static float load(_Float16 v) { return (float)v; }
  static _Float16 store(float v) { return (_Float16)v; }  // round to nearest even, as __float2half_rn
};
template <>
struct Codec<Bfloat16> {
  using Compute = float;
  static float load(Bfloat16 v) {
    uint32_t bits = (uint32_t)v.bits << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  static Bfloat16 store(float f) {  // round to nearest even, as __float2bfloat16_rn
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((bits >> 16) | 0x40)};  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return {(uint16_t)(bits >> 16)};
  }
};

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

// ---- NCCL, one rank per communicator ------------------------------------------------
//
// With one rank a collective's result is its input, so each call is a
// device copy on the stream. That is enough for the NCCL plane's own work
// to run: fusion, the batched copies, the scale kernels, and the
// hierarchical plane (a one-rank communicator per host, the CPU plane
// across). A communicator of more ranks is refused: there are no peers to
// reach here.

constexpr int kNcclInvalidUsage = 5;

int ncclGetVersion(int* version) {
  *version = 22803;
  return kSuccess;
}
const char* ncclGetErrorString(int code) {
  return code == kNcclInvalidUsage ? "invalid usage: the fake NCCL serves one rank per communicator"
                                   : "an error (fake NCCL)";
}
struct NcclUniqueId {
  char internal[128];
};
int ncclGetUniqueId(NcclUniqueId* id) {
  memset(id->internal, 0, sizeof id->internal);
  snprintf(id->internal, sizeof id->internal, "fake nccl %d", (int)getpid());
  return kSuccess;
}
int ncclCommInitRank(void** comm, int ranks, NcclUniqueId, int rank) {
  if (ranks != 1 || rank != 0) return kNcclInvalidUsage;
  *comm = new int(current_device);
  return kSuccess;
}
int ncclCommDestroy(void* comm) {
  delete static_cast<int*>(comm);
  return kSuccess;
}
int ncclCommAbort(void* comm) { return ncclCommDestroy(comm); }

size_t nccl_type_size(int type) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return type >= 0 && type < 10 ? sizes[type] : 0;
}
int one_rank_copy(const void* from, void* to, size_t count, int type, int root, void* stream) {
  const size_t bytes = count * nccl_type_size(type);
  if (root != 0 || (bytes == 0 && count > 0)) return kNcclInvalidUsage;
  if (from != to) cudaMemcpyAsync(to, from, bytes, 4, stream);
  return kSuccess;
}
int ncclAllReduce(const void* from, void* to, size_t count, int type, int, void*, void* stream) {
  return one_rank_copy(from, to, count, type, 0, stream);
}
int ncclBroadcast(const void* from, void* to, size_t count, int type, int root, void*, void* stream) {
  return one_rank_copy(from, to, count, type, root, stream);
}
int ncclReduce(const void* from, void* to, size_t count, int type, int, int root, void*, void* stream) {
  return one_rank_copy(from, to, count, type, root, stream);
}
int ncclSend(const void*, size_t, int, int, void*, void*) { return kNcclInvalidUsage; }
int ncclRecv(void*, size_t, int, int, void*, void*) { return kNcclInvalidUsage; }
int ncclGroupStart() { return kSuccess; }
int ncclGroupEnd() { return kSuccess; }

// ---- for tests --------------------------------------------------------------------

// Queues a pause of `microseconds` on `stream`: a producer still running.
int fake_cuda_delay(void* stream, unsigned microseconds) {
  stream_of(stream)->push([=] { std::this_thread::sleep_for(std::chrono::microseconds(microseconds)); });
  return kSuccess;
}

// Whether this library is the fake: tests check before trusting it.
int fake_cuda_is_fake() { return 1; }

}  // extern "C"
