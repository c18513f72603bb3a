#include "device_plane.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "../adasum.h"

namespace unison {

DevicePlane::DevicePlane(const CudaRuntime& cuda, int device, Backend* host)
    : cuda_(cuda), device_(device), host_(host) {
  // Non-blocking: the plane's stream must not wait for the legacy default
  // stream, where a framework may be running the next step's kernels.
  ready_ = cuda_.check(cuda_.StreamCreateWithFlags(&stream_, CudaRuntime::kStreamNonBlocking), "creating a stream");
  if (ready_.ok()) ready_ = cuda_.check(cuda_.EventCreateWithFlags(&done_, CudaRuntime::kEventDisableTiming),
                                        "creating an event");
  if (ready_.ok()) ready_ = kernels_.load(cuda_);
}

DevicePlane::~DevicePlane() {
  DeviceGuard guard(cuda_, device_);
  if (stream_ != nullptr) cuda_.StreamSynchronize(stream_);
  end_group();
  if (pinned_ != nullptr) cuda_.FreeHost(pinned_);
  if (done_ != nullptr) cuda_.EventDestroy(done_);
  if (stream_ != nullptr) cuda_.StreamDestroy(stream_);
}

Status DevicePlane::wait_for(cudaEvent_t ready) {
  return cuda_.check(cuda_.StreamWaitEvent(stream_, ready, 0), "ordering the collective after its input");
}

Status DevicePlane::release_to(const std::vector<cudaStream_t>& consumers) {
  Status s = cuda_.check(cuda_.EventRecord(done_, stream_), "recording the collective's completion");
  for (size_t i = 0; s.ok() && i < consumers.size(); ++i)
    s = cuda_.check(cuda_.StreamWaitEvent(consumers[i], done_, 0), "ordering the caller's stream after the collective");
  return s;
}

Status DevicePlane::allocate_result(size_t bytes, void** out) { return allocate_device_result(cuda_, bytes, out); }

Status DevicePlane::zeros(size_t bytes, void** out) {
  Status s = cuda_.check(cuda_.Malloc(out, bytes > 0 ? bytes : 1), "allocating scratch device memory");
  if (!s.ok()) return s;
  scratch_.push_back(*out);
  return cuda_.check(cuda_.MemsetAsync(*out, 0, bytes, stream_), "zeroing scratch device memory");
}

Status DevicePlane::copy(void* to, const void* from, size_t bytes) {
  if (bytes == 0 || to == from) return Status::OK();
  return cuda_.check(cuda_.MemcpyAsync(to, from, bytes, CudaRuntime::kMemcpyDefault, stream_), "a device copy");
}

bool DevicePlane::busy() const { return done_ != nullptr && cuda_.EventQuery(done_) != 0; }

void DevicePlane::end_group() {
  if (scratch_.empty()) return;
  for (void* p : scratch_) cuda_.Free(p);  // cudaFree waits for the work that uses it
  scratch_.clear();
}

// ---- host staging --------------------------------------------------------------

class DevicePlane::Staging {
 public:
  explicit Staging(DevicePlane& plane) : plane_(plane) {}

  // Room for `bytes` in `pieces` pieces. Growing waits for the stream, so
  // the old memory is no longer being copied to or from.
  Status reserve(size_t bytes, size_t pieces) {
    const size_t needed = bytes + pieces * kAlign;
    if (needed <= plane_.pinned_bytes_) return Status::OK();
    const CudaRuntime& cuda = plane_.cuda_;
    Status s = cuda.check(cuda.StreamSynchronize(plane_.stream_), "waiting for the staging stream");
    if (plane_.pinned_ != nullptr) cuda.FreeHost(plane_.pinned_);
    plane_.pinned_ = nullptr;
    plane_.pinned_bytes_ = 0;
    void* pinned = nullptr;
    if (s.ok()) s = cuda.check(cuda.MallocHost(&pinned, needed), "allocating " + std::to_string(needed) +
                                                                      " bytes of pinned host memory for staging");
    if (!s.ok()) return s;
    plane_.pinned_ = static_cast<char*>(pinned);
    plane_.pinned_bytes_ = needed;
    return Status::OK();
  }

  // Host memory that will hold `bytes` from `device` once fetch() returns.
  char* in(const void* device, size_t bytes) {
    if (device == nullptr) return nullptr;
    char* host = take(bytes);
    queue(host, device, bytes);
    return host;
  }

  // Host memory whose bytes deliver() copies to `device`; `host` when the
  // output is the input's own memory (in place).
  char* out(void* device, size_t bytes, char* host = nullptr) {
    if (device == nullptr) return nullptr;
    if (host == nullptr) host = take(bytes);
    outputs_.push_back({host, device, bytes});
    return host;
  }

  Status fetch() {
    if (!error_.ok()) return error_;
    return plane_.cuda_.check(plane_.cuda_.StreamSynchronize(plane_.stream_), "copying to host memory for staging");
  }

  Status deliver() {
    for (const Output& o : outputs_) queue(o.device, o.host, o.bytes);
    return error_;
  }

 private:
  static constexpr size_t kAlign = 64;
  struct Output {
    char* host;
    void* device;
    size_t bytes;
  };
  char* take(size_t bytes) {
    char* p = plane_.pinned_ + used_;
    used_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return p;
  }
  void queue(void* to, const void* from, size_t bytes) {
    if (bytes == 0 || !error_.ok()) return;
    error_ = plane_.cuda_.check(
        plane_.cuda_.MemcpyAsync(to, from, bytes, CudaRuntime::kMemcpyDefault, plane_.stream_), "a staging copy");
  }
  DevicePlane& plane_;
  size_t used_ = 0;
  std::vector<Output> outputs_;
  Status error_;
};

namespace {
size_t sum(const std::vector<size_t>& v) {
  size_t total = 0;
  for (size_t x : v) total += x;
  return total;
}
}  // namespace

// Stages `segments` to host memory, runs `reduce` on the host copies, and
// copies the results back: the staged allreduce and Adasum alike.
template <typename Reduce>
Status DevicePlane::stage_segments(const std::vector<Segment>& segments, Reduce reduce) {
  Staging staging(*this);
  size_t bytes = 0;
  for (const Segment& s : segments) bytes += 2 * s.bytes;
  Status s = staging.reserve(bytes, 2 * segments.size());
  if (!s.ok()) return s;
  std::vector<Segment> host = segments;
  for (Segment& segment : host) {
    char* in = staging.in(segment.input, segment.bytes);
    segment.output = staging.out(segment.output, segment.bytes, segment.output == segment.input ? in : nullptr);
    segment.input = in;
  }
  s = staging.fetch();
  if (s.ok()) s = reduce(host);
  return s.ok() ? staging.deliver() : s;
}

Status DevicePlane::stage_allreduce(const AllreduceOptions& o, DataPlane* across) {
  DataPlane* backend = across != nullptr ? across : host_;
  return stage_segments(o.segments, [&](const std::vector<Segment>& host) {
    return backend->allreduce(AllreduceOptions{host, o.reduce});
  });
}

Status DevicePlane::adasum(int dtype, const std::vector<Segment>& segments) {
  return stage_segments(segments, [&](const std::vector<Segment>& host) {
    return adasum_allreduce(*host_, dtype, host);
  });
}

Status DevicePlane::stage_allgather(const AllgatherOptions& o) {
  Staging staging(*this);
  size_t bytes = 0;
  for (const auto& t : o.tensors) bytes += t.bytes_per_rank[rank()] + sum(t.bytes_per_rank);
  Status s = staging.reserve(bytes, 2 * o.tensors.size());
  if (!s.ok()) return s;
  AllgatherOptions host = o;
  for (auto& t : host.tensors) {
    t.input = staging.in(t.input, t.bytes_per_rank[rank()]);
    t.output = staging.out(t.output, sum(t.bytes_per_rank));
  }
  s = staging.fetch();
  if (s.ok()) s = host_->allgather(host);
  return s.ok() ? staging.deliver() : s;
}

Status DevicePlane::stage_broadcast(const BroadcastOptions& o) {
  Staging staging(*this);
  Status s = staging.reserve(o.bytes, 1);
  if (!s.ok()) return s;
  BroadcastOptions host = o;
  // Only the root's bytes matter; the others' are overwritten.
  char* buffer = rank() == o.root ? staging.in(o.buffer, o.bytes) : nullptr;
  host.buffer = staging.out(o.buffer, o.bytes, buffer);
  s = staging.fetch();
  if (s.ok()) s = host_->broadcast(host);
  return s.ok() ? staging.deliver() : s;
}

Status DevicePlane::stage_alltoall(const AlltoallOptions& o) {
  const int n = size(), me = rank();
  size_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    sent += o.bytes[(size_t)me * n + p];
    received += o.bytes[(size_t)p * n + me];
  }
  Staging staging(*this);
  Status s = staging.reserve(sent + received, 2);
  if (!s.ok()) return s;
  AlltoallOptions host = o;
  host.input = staging.in(o.input, sent);
  host.output = staging.out(o.output, received);
  s = staging.fetch();
  if (s.ok()) s = host_->alltoall(host);
  return s.ok() ? staging.deliver() : s;
}

Status DevicePlane::stage_reducescatter(const ReducescatterOptions& o) {
  Staging staging(*this);
  size_t bytes = 0;
  for (const auto& t : o.tensors) bytes += sum(t.bytes_per_rank) + t.bytes_per_rank[rank()];
  Status s = staging.reserve(bytes, 2 * o.tensors.size());
  if (!s.ok()) return s;
  ReducescatterOptions host = o;
  for (auto& t : host.tensors) {
    t.input = staging.in(t.input, sum(t.bytes_per_rank));
    t.output = staging.out(t.output, t.bytes_per_rank[rank()]);
  }
  s = staging.fetch();
  if (s.ok()) s = host_->reducescatter(host);
  return s.ok() ? staging.deliver() : s;
}

}  // namespace unison
