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
// - NCCL calls run on their stream too, and move bytes between the ranks'
//   processes through shared memory (the NCCL section says how), with a
//   GPU per local rank where FAKE_CUDA_DEVICES gives several.
// What it cannot catch: the core touching device memory from the host
// outside a stream (here that memory is readable), and anything about
// speed.
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include <type_traits>
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

}  // extern "C"

// ---- NCCL: ranks in separate processes, meeting in shared memory ---------------------
//
// A communicator of n ranks is a shared-memory segment named by its unique
// id, with a one-way channel for every ordered pair of ranks. Each call
// runs when its stream reaches it, as NCCL's kernels do, and moves its
// bytes as messages on those channels:
// - a broadcast's root sends to every other rank;
// - a reduce's ranks send to the root, which combines the n inputs in rank
//   order;
// - an allreduce's ranks send to every other rank, and each combines the n
//   inputs in rank order, so that every rank ends with the same bits;
// - ncclSend and ncclRecv are one message each.
// The calls between ncclGroupStart and ncclGroupEnd run as one piece of
// stream work whose messages all progress together, so a group of sends
// and receives that would deadlock one by one completes, as in NCCL.
//
// Each message starts with its length and its call's kind and type. A
// receiver checks them against its own call and stops the process naming
// both: that is how a core that issued its calls in another order, or with
// other sizes, on two ranks shows up here (a GPU would hang or corrupt). A
// wait of over two minutes for a peer also stops it, naming who waited for
// whom, rather than hanging the test.

namespace {

constexpr int kNcclSystemError = 2;
constexpr int kNcclInvalidUsage = 5;
constexpr size_t kChannelBytes = 256 << 10;
constexpr auto kPeerTimeout = std::chrono::seconds(120);

[[noreturn]] void stop(const std::string& why) {
  fprintf(stderr, "fake NCCL: %s\n", why.c_str());
  fflush(stderr);
  abort();
}

// One writer, one reader; the ring holds bytes [read, written) and both
// counters only grow. A new segment is zeros, which is where both counters
// start, so no rank has to set it up before the others map it.
struct Channel {
  alignas(64) std::atomic<uint64_t> written;
  alignas(64) std::atomic<uint64_t> read;
  alignas(64) char ring[kChannelBytes];
};
struct SharedHead {
  alignas(64) std::atomic<int> joined;
};  // followed by ranks * ranks channels, from * ranks + to

struct Comm {
  int ranks = 1, rank = 0;
  char* shared = nullptr;  // a SharedHead and the channels; none for one rank
  size_t shared_bytes = 0;
  std::atomic<bool> aborted{false};

  Channel* channel(int from, int to) const {
    return reinterpret_cast<Channel*>(shared + sizeof(SharedHead)) + (size_t)from * ranks + to;
  }
};

enum CallKind : uint32_t { kAllReduceCall, kBroadcastCall, kReduceCall, kPointToPointCall };
const char* kind_name(uint32_t kind) {
  static const char* names[] = {"an allreduce", "a broadcast", "a reduce", "a send"};
  return kind < 4 ? names[kind] : "something unknown";
}

struct Call {
  uint32_t kind;
  const void* from;
  void* to;
  size_t count;
  int type, op;
  int root;  // or the peer of a send or a receive
  bool sending;
};

size_t nccl_type_size(int type) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return type >= 0 && type < 10 ? sizes[type] : 0;
}

struct Header {
  uint64_t bytes;
  uint32_t kind, type;
  bool operator==(const Header& o) const { return bytes == o.bytes && kind == o.kind && type == o.type; }
};

struct Message {
  int peer;
  bool sending;
  char* data;     // the payload: read when sending, written when receiving
  Header header;  // what is sent, or what is expected
  Header arrived{};
  size_t moved = 0;  // of the header and payload
  size_t total() const { return sizeof(Header) + header.bytes; }
};

std::string describe(const Header& h) {
  return std::string(kind_name(h.kind)) + " of " + std::to_string(h.bytes) + " bytes of NCCL type " +
         std::to_string(h.type);
}

// Moves `n` bytes of `m`, from where it is, between it and `ring`.
void move_bytes(Message& m, char* ring, size_t n) {
  for (size_t done = 0; done < n;) {
    const size_t at = m.moved + done;
    const bool in_header = at < sizeof(Header);
    char* mine = in_header ? reinterpret_cast<char*>(m.sending ? &m.header : &m.arrived) + at
                           : m.data + (at - sizeof(Header));
    const size_t part = std::min(n - done, in_header ? sizeof(Header) - at : m.total() - at);
    if (m.sending) memcpy(ring + done, mine, part);
    else memcpy(mine, ring + done, part);
    done += part;
  }
}

// Moves as much of `m` as its channel allows now; returns how much.
size_t advance(const Comm& c, Message& m) {
  Channel* ch = m.sending ? c.channel(c.rank, m.peer) : c.channel(m.peer, c.rank);
  size_t moved = 0;
  while (m.moved < m.total()) {
    const uint64_t written = ch->written.load(std::memory_order_acquire);
    const uint64_t read = ch->read.load(std::memory_order_acquire);
    const uint64_t at = m.sending ? written : read;
    const size_t ready = m.sending ? kChannelBytes - (written - read) : written - read;
    size_t n = std::min({ready, m.total() - m.moved, kChannelBytes - at % kChannelBytes});
    if (!m.sending && m.moved < sizeof(Header)) n = std::min(n, sizeof(Header) - m.moved);  // to check it first
    if (n == 0) break;
    move_bytes(m, ch->ring + at % kChannelBytes, n);
    m.moved += n;
    moved += n;
    (m.sending ? ch->written : ch->read).store(at + n, std::memory_order_release);
    if (!m.sending && m.moved == sizeof(Header) && !(m.arrived == m.header))
      stop("rank " + std::to_string(c.rank) + " expected " + describe(m.header) + " from rank " +
           std::to_string(m.peer) + ", which sent " + describe(m.arrived) +
           ": the ranks' calls on this communicator differ");
  }
  return moved;
}

// Runs `messages` together; a message waits for the earlier ones on its
// channel, since the channel carries them in order.
void exchange(Comm& c, std::vector<Message>& messages) {
  auto last_progress = std::chrono::steady_clock::now();
  unsigned idle = 0;
  for (;;) {
    std::vector<char> sending_busy(c.ranks), receiving_busy(c.ranks);
    const Message* waiting = nullptr;
    size_t moved = 0;
    for (Message& m : messages) {
      if (m.moved == m.total()) continue;
      char& busy = m.sending ? sending_busy[m.peer] : receiving_busy[m.peer];
      if (busy) continue;
      moved += advance(c, m);
      if (m.moved < m.total()) {
        busy = true;
        if (waiting == nullptr) waiting = &m;
      }
    }
    if (waiting == nullptr || c.aborted.load()) return;
    if (moved > 0) {
      last_progress = std::chrono::steady_clock::now();
      idle = 0;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      if (std::chrono::steady_clock::now() - last_progress > kPeerTimeout)
        stop("rank " + std::to_string(c.rank) + " waited " + std::to_string(kPeerTimeout.count()) + " s for rank " +
             std::to_string(waiting->peer) + (waiting->sending ? " to take " : " to send ") +
             describe(waiting->header) + ": a peer never made the matching call");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

template <typename T>
void reduce_into(T* acc, const T* in, size_t n, int op) {
  using C = typename Codec<T>::Compute;
  for (size_t i = 0; i < n; ++i) {
    const C a = Codec<T>::load(acc[i]), b = Codec<T>::load(in[i]);
    C r;
    if constexpr (std::is_integral_v<C>) {  // wrapping, as NCCL's integers do
      using U = std::make_unsigned_t<C>;
      r = op == 0 ? (C)(U)((U)a + (U)b) : op == 1 ? (C)(U)((U)a * (U)b) : op == 2 ? std::max(a, b) : std::min(a, b);
    } else {
      r = op == 0 ? a + b : op == 1 ? a * b : op == 2 ? (a < b ? b : a) : (b < a ? b : a);
    }
    acc[i] = Codec<T>::store(r);
  }
}

void reduce_into(char* acc, const char* in, size_t count, int type, int op) {
  switch (type) {
    case 0: return reduce_into((int8_t*)acc, (const int8_t*)in, count, op);
    case 1: return reduce_into((uint8_t*)acc, (const uint8_t*)in, count, op);
    case 2: return reduce_into((int32_t*)acc, (const int32_t*)in, count, op);
    case 3: return reduce_into((uint32_t*)acc, (const uint32_t*)in, count, op);
    case 4: return reduce_into((int64_t*)acc, (const int64_t*)in, count, op);
    case 5: return reduce_into((uint64_t*)acc, (const uint64_t*)in, count, op);
    case 6: return reduce_into((_Float16*)acc, (const _Float16*)in, count, op);
    case 7: return reduce_into((float*)acc, (const float*)in, count, op);
    case 8: return reduce_into((double*)acc, (const double*)in, count, op);
    case 9: return reduce_into((Bfloat16*)acc, (const Bfloat16*)in, count, op);
  }
}

// The ranks' inputs combined in rank order into `to` (which may be one of them).
void combine(const std::vector<const char*>& inputs, void* to, const Call& call) {
  const size_t bytes = call.count * nccl_type_size(call.type);
  std::vector<char> result(inputs[0], inputs[0] + bytes);
  for (size_t r = 1; r < inputs.size(); ++r) reduce_into(result.data(), inputs[r], call.count, call.type, call.op);
  memcpy(to, result.data(), bytes);
}

void run_calls(Comm& c, const std::vector<Call>& calls) {
  std::vector<Message> messages;
  std::vector<std::vector<char>> received;  // peers' inputs to a reduction
  std::vector<std::function<void()>> then;  // each call's work once every message is through
  for (const Call& call : calls) {
    const Header header{call.count * nccl_type_size(call.type), call.kind, (uint32_t)call.type};
    char* from = const_cast<char*>(static_cast<const char*>(call.from));
    char* to = static_cast<char*>(call.to);
    auto send = [&](int peer) { messages.push_back({peer, true, from, header}); };
    auto receive = [&](int peer, char* into) { messages.push_back({peer, false, into, header}); };
    if (call.kind == kPointToPointCall) {
      if (call.sending) send(call.root);
      else receive(call.root, to);
    } else if (call.kind == kBroadcastCall) {
      for (int p = 0; p < c.ranks && c.rank == call.root; ++p)
        if (p != c.rank) send(p);
      if (c.rank != call.root) receive(call.root, to);
      if (c.rank == call.root && from != to) then.push_back([=] { memmove(to, from, header.bytes); });
    } else {  // a reduce or an allreduce
      const bool gets_result = call.kind == kAllReduceCall || c.rank == call.root;
      std::vector<const char*> inputs(c.ranks);
      inputs[c.rank] = from;
      for (int p = 0; p < c.ranks; ++p) {
        if (p == c.rank) continue;
        if (call.kind == kAllReduceCall || p == call.root) send(p);
        if (!gets_result) continue;
        received.emplace_back(header.bytes);
        inputs[p] = received.back().data();  // a moved vector keeps its bytes where they are
        receive(p, received.back().data());
      }
      if (gets_result) then.push_back([=] { combine(inputs, to, call); });
    }
  }
  exchange(c, messages);
  if (!c.aborted.load())
    for (auto& work : then) work();
}

thread_local int group_depth = 0;
thread_local std::vector<Call> group_calls;
thread_local Comm* group_comm = nullptr;
thread_local void* group_stream = nullptr;

void run_on_stream(Comm* c, std::vector<Call> calls, void* stream) {
  stream_of(stream)->push([c, calls = std::move(calls)] { device_work([&] { run_calls(*c, calls); }); });
}

int enqueue(void* comm, const Call& call, void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  if (c == nullptr || nccl_type_size(call.type) == 0 || call.root < 0 || call.root >= c->ranks) return kNcclInvalidUsage;
  if (call.kind == kPointToPointCall && call.root == c->rank) return kNcclInvalidUsage;  // the core copies its own rows
  if ((call.kind == kAllReduceCall || call.kind == kReduceCall) && (call.op < 0 || call.op > 3))
    return kNcclInvalidUsage;
  if (group_depth == 0) {
    run_on_stream(c, {call}, stream);
    return kSuccess;
  }
  // A group runs as one piece of work: on one communicator and stream here.
  if (!group_calls.empty() && (group_comm != c || group_stream != stream)) return kNcclInvalidUsage;
  group_comm = c;
  group_stream = stream;
  group_calls.push_back(call);
  return kSuccess;
}

}  // namespace

extern "C" {

int ncclGetVersion(int* version) {
  *version = 22803;
  return kSuccess;
}
const char* ncclGetErrorString(int code) {
  switch (code) {
    case kNcclSystemError: return "system error: shared memory for the communicator (fake NCCL)";
    case kNcclInvalidUsage: return "invalid usage (fake NCCL)";
    default: return "an error (fake NCCL)";
  }
}
struct NcclUniqueId {
  char internal[128];
};
// Names the communicator's shared-memory segment.
int ncclGetUniqueId(NcclUniqueId* id) {
  static std::atomic<unsigned> made{0};
  memset(id->internal, 0, sizeof id->internal);
  snprintf(id->internal, sizeof id->internal, "/unison-fake-nccl-%d-%u-%llx", (int)getpid(), made++,
           (unsigned long long)std::chrono::steady_clock::now().time_since_epoch().count());
  return kSuccess;
}
// Waits for the others to join, as NCCL does; the last to join unlinks the
// name, so nothing is left in /dev/shm once all have it mapped.
int ncclCommInitRank(void** comm, int ranks, NcclUniqueId id, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks) return kNcclInvalidUsage;
  auto c = std::make_unique<Comm>();
  c->ranks = ranks;
  c->rank = rank;
  if (ranks > 1) {
    id.internal[sizeof id.internal - 1] = 0;
    c->shared_bytes = sizeof(SharedHead) + sizeof(Channel) * ranks * ranks;
    const int fd = shm_open(id.internal, O_CREAT | O_RDWR, 0600);
    if (fd < 0) return kNcclSystemError;
    void* mapped = ftruncate(fd, (off_t)c->shared_bytes) == 0
                       ? mmap(nullptr, c->shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
    close(fd);
    if (mapped == MAP_FAILED) return kNcclSystemError;
    c->shared = static_cast<char*>(mapped);
    auto* head = reinterpret_cast<SharedHead*>(c->shared);
    if (head->joined.fetch_add(1) + 1 == ranks) shm_unlink(id.internal);
    const auto started = std::chrono::steady_clock::now();
    while (head->joined.load() < ranks) {
      if (std::chrono::steady_clock::now() - started > kPeerTimeout)
        stop("rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " waited " +
             std::to_string(kPeerTimeout.count()) + " s for the others to join communicator " + id.internal);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  *comm = c.release();
  return kSuccess;
}
int ncclCommDestroy(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  if (c->shared != nullptr) munmap(c->shared, c->shared_bytes);
  delete c;
  return kSuccess;
}
// Work under way stops at its next wait; the communicator is kept, since
// that work may still be reading it.
int ncclCommAbort(void* comm) {
  static_cast<Comm*>(comm)->aborted = true;
  return kSuccess;
}

int ncclAllReduce(const void* from, void* to, size_t count, int type, int op, void* comm, void* stream) {
  return enqueue(comm, {kAllReduceCall, from, to, count, type, op, 0, false}, stream);
}
int ncclBroadcast(const void* from, void* to, size_t count, int type, int root, void* comm, void* stream) {
  return enqueue(comm, {kBroadcastCall, from, to, count, type, 0, root, false}, stream);
}
int ncclReduce(const void* from, void* to, size_t count, int type, int op, int root, void* comm, void* stream) {
  return enqueue(comm, {kReduceCall, from, to, count, type, op, root, false}, stream);
}
int ncclSend(const void* from, size_t count, int type, int peer, void* comm, void* stream) {
  return enqueue(comm, {kPointToPointCall, from, nullptr, count, type, 0, peer, true}, stream);
}
int ncclRecv(void* to, size_t count, int type, int peer, void* comm, void* stream) {
  return enqueue(comm, {kPointToPointCall, nullptr, to, count, type, 0, peer, false}, stream);
}
int ncclGroupStart() {
  ++group_depth;
  return kSuccess;
}
int ncclGroupEnd() {
  if (group_depth == 0) return kNcclInvalidUsage;
  if (--group_depth > 0 || group_calls.empty()) return kSuccess;
  run_on_stream(group_comm, std::move(group_calls), group_stream);
  group_calls.clear();
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
