// The NCCL plane: collectives on device memory through NCCL, one
// communicator per process set and device. The unique ids that NCCL's ranks
// meet by travel over the set's CPU backend.
//
// Allreduce fuses on the device: one batched-copy launch per 64 tensors
// packs the group into a persistent fusion buffer (a prescale is a kernel
// per tensor instead), NCCL reduces it in place, and another batched copy
// unpacks it; Average and postscale run as a kernel on the buffer
// (../cuda/device_kernels.cu), so results match the CPU path's bits.
// Ragged allgather and reducescatter are grouped broadcasts and reduces,
// since NCCL's own need equal parts; alltoall is grouped sends and
// receives. What NCCL cannot reduce (16-bit integers) is staged through
// host memory like the fallback plane.
//
// Across hosts the plane is hierarchical by default (NcclLayout): the
// communicator spans one host, and an allreduce goes in three steps. The
// host's ranks reduce chunk l of the buffer to local rank l (grouped NCCL
// reduces); cross group l allreduces chunk l between hosts on the CPU
// backend, through pinned host memory; the finished chunks are broadcast
// back within the host. Every local rank carries its chunk at once, so a
// host's links are all busy, and no byte crosses a host boundary twice.
// The other collectives, which move each byte once anyway, are staged
// through host memory onto the set's CPU backend. A cluster whose NCCL
// reaches across hosts faster (RDMA) asks for the flat communicator with
// UNISON_HIERARCHICAL_ALLREDUCE=0.
#include "nccl_plane.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "../dtype.h"
#include "../log.h"
#include "library.h"

namespace unison {
namespace {

// NCCL's type and operation for a reduction, or false where it has none.
bool nccl_reduction(const ReduceSpec& spec, int* type, int* op) {
  switch (spec.dtype) {
    case UNISON_INT8: *type = NcclLibrary::kInt8; break;
    case UNISON_UINT8: case UNISON_BOOL: *type = NcclLibrary::kUint8; break;
    case UNISON_INT32: *type = NcclLibrary::kInt32; break;
    case UNISON_UINT32: *type = NcclLibrary::kUint32; break;
    case UNISON_INT64: *type = NcclLibrary::kInt64; break;
    case UNISON_UINT64: *type = NcclLibrary::kUint64; break;
    case UNISON_FLOAT16: *type = NcclLibrary::kFloat16; break;
    case UNISON_BFLOAT16: *type = NcclLibrary::kBfloat16; break;
    case UNISON_FLOAT32: *type = NcclLibrary::kFloat32; break;
    case UNISON_FLOAT64: *type = NcclLibrary::kFloat64; break;
    default: return false;
  }
  switch (spec.reduce_op) {
    case UNISON_SUM: case UNISON_AVERAGE: *op = NcclLibrary::kSum; break;
    case UNISON_PRODUCT: *op = NcclLibrary::kProd; break;
    case UNISON_MIN: *op = NcclLibrary::kMin; break;
    case UNISON_MAX: *op = NcclLibrary::kMax; break;
    default: return false;
  }
  // Bools are 0 or 1 bytes: Sum means any (Max), Product all (Min).
  if (spec.dtype == UNISON_BOOL) *op = spec.reduce_op == UNISON_SUM || spec.reduce_op == UNISON_MAX ? NcclLibrary::kMax
                                                                                                    : NcclLibrary::kMin;
  return true;
}

// How often the ranks tell each other how their NCCL init stands, and how
// long one runs before rank 0 says which ranks are still at it.
constexpr double kInitPollSeconds = 0.02;
constexpr double kSlowInitWarningSeconds = 30;

// An error's text for another rank's message, without the "unison: " it
// will be quoted under, and short enough for any control message.
std::string without_prefix(const std::string& message) {
  const std::string prefix = "unison: ";
  return message.substr(message.rfind(prefix, 0) == 0 ? prefix.size() : 0, 1000);
}

void abort_communicator(const NcclLibrary& nccl, const CudaRuntime& cuda, int device, ncclComm_t comm) {
  DeviceGuard guard(cuda, device);
  nccl.CommAbort(comm);
}

// One rank's ncclCommInitRank, shared by the thread that runs it and the
// plane that waits for it. A plane that gives up first marks it abandoned:
// the thread, should NCCL ever return, aborts the communicator it got, and
// otherwise stays blocked inside NCCL with nothing of the plane's to touch.
struct CommunicatorInit {
  std::mutex mutex;
  std::condition_variable done_bell;
  bool done = false;
  bool abandoned = false;
  Status status;
  ncclComm_t comm = nullptr;
};

void give_up(const std::shared_ptr<CommunicatorInit>& init, const NcclLibrary& nccl, const CudaRuntime& cuda,
             int device) {
  std::lock_guard<std::mutex> lock(init->mutex);
  init->abandoned = true;
  if (init->done && init->comm != nullptr) abort_communicator(nccl, cuda, device, init->comm);
}

class NcclPlane : public DevicePlane {
 public:
  NcclPlane(const CudaRuntime& cuda, int device, Backend* host, const NcclLibrary& nccl, const NcclLayout& layout)
      : DevicePlane(cuda, device, host), nccl_(nccl), layout_(layout) {
    local_rank_ = (int)(std::find(layout_.communicator.begin(), layout_.communicator.end(), rank()) -
                        layout_.communicator.begin());
  }

  ~NcclPlane() override {
    DeviceGuard guard(cuda_, device_);
    if (stream_ != nullptr) cuda_.StreamSynchronize(stream_);
    if (comm_ != nullptr) nccl_.CommDestroy(comm_);
    if (fusion_ != nullptr) cuda_.Free(fusion_);
  }

  void abandon() override {
    if (comm_ == nullptr) return;
    abort_communicator(nccl_, cuda_, device_, comm_);
    comm_ = nullptr;
  }

  // Collective over the set. Each communicator's first rank makes its id
  // and one allgather on the host backend carries them all; then the cross
  // groups are split off the host backend, in the same order everywhere.
  Status init() {
    if (!ready_.ok()) return ready_;
    std::vector<ncclUniqueId> ids(size());
    ncclUniqueId mine{};
    if (rank() == layout_.communicator[0]) {
      Status s = nccl_.check(nccl_.GetUniqueId(&mine), "ncclGetUniqueId");
      if (!s.ok()) return s;
    }
    AllgatherOptions gather;
    gather.tensors.push_back({&mine, ids.data(), std::vector<size_t>(size(), sizeof(ncclUniqueId))});
    Status s = host_->allgather(gather);
    if (!s.ok()) return s;
    s = init_communicator(ids[layout_.communicator[0]]);
    for (size_t l = 0; s.ok() && l < layout_.cross_groups.size(); ++l) {
      std::unique_ptr<Backend> group;
      s = host_->split(layout_.cross_groups[l], layout_.cross_group_id + (int)l, &group);
      if (group != nullptr) cross_ = std::move(group);
    }
    return s;
  }

  const char* name() const override { return hierarchical() ? "nccl_hierarchical" : "nccl"; }

  Status asynchronous_error() const override {
    ncclResult_t state = 0;
    if (comm_ == nullptr || nccl_.CommGetAsyncError(comm_, &state) != 0 || state == NcclLibrary::kInProgress)
      return Status::OK();
    Status s = nccl_.check(state, "NCCL's communicator on GPU " + std::to_string(device_));
    if (!s.ok()) s.message += ", with collectives still running; they were aborted";
    return s;
  }

  // ncclCommInitRank returns only once every rank of the communicator has
  // joined, and nothing interrupts it. A rank whose own init fails after
  // the ids went round, or whose process dies, would leave its peers inside
  // it for good. So the init runs on a thread of its own, and meanwhile the
  // ranks of the set meet on the host backend every kInitPollSeconds to say
  // how theirs stands. Everyone sees the same answers and decides alike:
  // all done, go on; a rank failed, fail here too, naming it and its reason;
  // a rank lost, the host backend's own error names it. A thread still
  // inside NCCL then is left there (see CommunicatorInit).
  Status init_communicator(const ncclUniqueId& id) {
    const int ranks = (int)layout_.communicator.size();
    auto init = std::make_shared<CommunicatorInit>();
    std::thread([init, &nccl = nccl_, &cuda = cuda_, device = device_, ranks, id, me = local_rank_] {
      ncclComm_t comm = nullptr;
      Status s;
      {
        DeviceGuard guard(cuda, device);
        s = nccl.check(nccl.CommInitRank(&comm, ranks, id, me), "ncclCommInitRank (" + std::to_string(ranks) +
                                                                    " ranks)");
      }
      std::lock_guard<std::mutex> lock(init->mutex);
      if (init->abandoned) {
        if (s.ok()) abort_communicator(nccl, cuda, device, comm);
        return;
      }
      init->done = true;
      init->status = s;
      init->comm = comm;
      init->done_bell.notify_all();
    }).detach();

    const auto started = std::chrono::steady_clock::now();
    double next_warning = kSlowInitWarningSeconds;
    for (;;) {
      std::string mine;  // "" while NCCL is still at it
      {
        std::unique_lock<std::mutex> lock(init->mutex);
        init->done_bell.wait_for(lock, std::chrono::duration<double>(kInitPollSeconds), [&] { return init->done; });
        if (init->done) mine = init->status.ok() ? "ok" : "failed: " + without_prefix(init->status.message);
      }
      std::vector<std::string> everyone;
      Status s = host_->exchange(mine, &everyone);
      std::vector<int> busy;
      for (int r = 0; s.ok() && r < (int)everyone.size(); ++r) {
        if (everyone[r].empty()) busy.push_back(r);
        if (everyone[r].rfind("failed: ", 0) == 0)
          s = r == rank() ? init->status
                          : Status::Error(UNISON_ERR_INTERNAL, "unison: rank " + std::to_string(r) +
                                                                   " could not set up NCCL (" +
                                                                   everyone[r].substr(8) + ")");
      }
      if (!s.ok()) {
        give_up(init, nccl_, cuda_, device_);
        return s;
      }
      if (busy.empty()) break;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (rank() == 0 && waited >= next_warning) {
        std::string who;
        for (int r : busy) who += (who.empty() ? "" : ", ") + std::to_string(r);
        log_message(LogLevel::warning, "unison: NCCL has been setting up a communicator on GPU %d for %.0f s; "
                    "ranks %s of the process set have not finished", device_, waited, who.c_str());
        next_warning += kSlowInitWarningSeconds;
      }
    }
    comm_ = init->comm;
    return Status::OK();
  }

  Status allreduce(const AllreduceOptions& o) override {
    int type = 0, op = 0;
    if (!nccl_reduction(o.reduce, &type, &op)) return stage_allreduce(o);
    const ReduceSpec& spec = o.reduce;
    const size_t element = dtype_size(spec.dtype);
    Status s;
    if (o.segments.size() == 1 && !hierarchical()) {  // no fusion: reduce straight into the output
      const Segment& t = o.segments[0];
      const uint64_t count = t.bytes / element;
      const void* from = t.input;
      if (spec.prescale != 1.0) {
        s = kernels_.prescale(spec.dtype, t.output, t.input, count, spec.prescale, stream_);
        from = t.output;
      }
      if (s.ok() && count > 0)
        s = nccl_.check(nccl_.AllReduce(from, t.output, count, type, op, comm_, stream_), "ncclAllReduce");
      return s.ok() ? finish(spec, t.output, count) : s;
    }
    // One tensor is worked on in its output; more are fused.
    char* buffer = nullptr;
    uint64_t count = 0;
    std::vector<Segment> unpack;
    s = pack(o, &buffer, &count, &unpack);
    if (s.ok() && !hierarchical() && count > 0)
      s = nccl_.check(nccl_.AllReduce(buffer, buffer, count, type, op, comm_, stream_), "ncclAllReduce");
    if (s.ok() && !hierarchical()) s = finish(spec, buffer, count);
    if (s.ok() && hierarchical()) s = hierarchical_allreduce(spec, type, op, buffer, count);
    if (s.ok()) s = kernels_.copy(unpack, stream_);
    return s;
  }

  Status allgather(const AllgatherOptions& o) override {
    if (hierarchical()) return stage_allgather(o);
    // Rank p's part of each tensor is broadcast from p to its offset in
    // everyone's output; the parts may differ in size.
    return grouped([&] {
      Status s;
      for (const auto& t : o.tensors) {
        size_t offset = 0;
        for (int p = 0; s.ok() && p < size(); offset += t.bytes_per_rank[p], ++p) {
          char* to = static_cast<char*>(t.output) + offset;
          if (t.bytes_per_rank[p] == 0) continue;
          s = nccl_.check(nccl_.Broadcast(p == rank() ? t.input : to, to, t.bytes_per_rank[p], NcclLibrary::kUint8, p,
                                          comm_, stream_),
                          "ncclBroadcast");
        }
      }
      return s;
    });
  }

  Status broadcast(const BroadcastOptions& o) override {
    if (hierarchical()) return stage_broadcast(o);
    if (o.bytes == 0) return Status::OK();
    return nccl_.check(nccl_.Broadcast(o.buffer, o.buffer, o.bytes, NcclLibrary::kUint8, o.root, comm_, stream_),
                       "ncclBroadcast");
  }

  Status alltoall(const AlltoallOptions& o) override {
    if (hierarchical()) return stage_alltoall(o);
    const int n = size(), me = rank();
    std::vector<size_t> send_at(n, 0), receive_at(n, 0);
    for (int p = 1; p < n; ++p) {
      send_at[p] = send_at[p - 1] + o.bytes[(size_t)me * n + p - 1];
      receive_at[p] = receive_at[p - 1] + o.bytes[(size_t)(p - 1) * n + me];
    }
    const char* input = static_cast<const char*>(o.input);
    char* output = static_cast<char*>(o.output);
    // This rank's own rows are a device copy; NCCL gets the peers.
    Status s = copy(output + receive_at[me], input + send_at[me], o.bytes[(size_t)me * n + me]);
    if (!s.ok()) return s;
    return grouped([&] {
      Status s;
      for (int p = 0; s.ok() && p < n; ++p) {
        if (p == me) continue;
        const size_t out = o.bytes[(size_t)me * n + p], in = o.bytes[(size_t)p * n + me];
        if (out > 0)
          s = nccl_.check(nccl_.Send(input + send_at[p], out, NcclLibrary::kUint8, p, comm_, stream_), "ncclSend");
        if (s.ok() && in > 0)
          s = nccl_.check(nccl_.Recv(output + receive_at[p], in, NcclLibrary::kUint8, p, comm_, stream_), "ncclRecv");
      }
      return s;
    });
  }

  Status reducescatter(const ReducescatterOptions& o) override {
    int type = 0, op = 0;
    if (hierarchical() || !nccl_reduction(o.reduce, &type, &op)) return stage_reducescatter(o);
    const ReduceSpec& spec = o.reduce;
    const size_t element = dtype_size(spec.dtype);
    Status s;
    for (const auto& t : o.tensors) {
      // Each rank's part is reduced to it; the parts may differ in size.
      size_t total = 0;
      for (size_t b : t.bytes_per_rank) total += b;
      const char* from = static_cast<const char*>(t.input);
      if (spec.prescale != 1.0) {
        s = fusion_buffer(total);
        if (s.ok()) s = kernels_.prescale(spec.dtype, fusion_, t.input, total / element, spec.prescale, stream_);
        from = fusion_;
      }
      if (s.ok()) s = grouped([&] {
        Status s;
        size_t offset = 0;
        for (int p = 0; s.ok() && p < size(); offset += t.bytes_per_rank[p], ++p) {
          if (t.bytes_per_rank[p] == 0) continue;
          s = nccl_.check(nccl_.Reduce(from + offset, t.output, t.bytes_per_rank[p] / element, type, op, p, comm_,
                                       stream_),
                          "ncclReduce");
        }
        return s;
      });
      if (s.ok()) s = finish(spec, t.output, t.bytes_per_rank[rank()] / element);
      if (!s.ok()) return s;
    }
    return s;
  }

 private:
  bool hierarchical() const { return !layout_.cross_groups.empty(); }

  // NCCL calls between ncclGroupStart and ncclGroupEnd, which run as one.
  template <typename Calls>
  Status grouped(Calls calls) {
    Status s = nccl_.check(nccl_.GroupStart(), "ncclGroupStart");
    if (!s.ok()) return s;
    s = calls();
    Status ended = nccl_.check(nccl_.GroupEnd(), "ncclGroupEnd");
    return s.ok() ? ended : s;
  }

  // Average's division and the postscale, after the sum.
  Status finish(const ReduceSpec& spec, void* data, uint64_t count) {
    const int divisor = spec.reduce_op == UNISON_AVERAGE ? spec.ranks : 1;
    if (divisor <= 1 && spec.postscale == 1.0) return Status::OK();
    return kernels_.finish(spec.dtype, data, count, divisor, spec.postscale, stream_);
  }

  // The allreduce's input, prescaled, in one buffer of *count elements: the
  // output of a lone tensor, else the fusion buffer, where each tensor
  // starts at a multiple of 16 bytes (whole elements of any type), so the
  // batched copies move 16-byte words. The gaps are reduced with the rest
  // and never read. *unpack is what copies the results out.
  Status pack(const AllreduceOptions& o, char** buffer, uint64_t* count, std::vector<Segment>* unpack) {
    const ReduceSpec& spec = o.reduce;
    const size_t element = dtype_size(spec.dtype);
    if (o.segments.size() == 1) {
      const Segment& t = o.segments[0];
      *buffer = static_cast<char*>(t.output);
      *count = t.bytes / element;
      if (spec.prescale != 1.0) return kernels_.prescale(spec.dtype, t.output, t.input, *count, spec.prescale, stream_);
      return copy(t.output, t.input, t.bytes);
    }
    std::vector<size_t> at;
    size_t total = 0;
    for (const Segment& t : o.segments) {
      at.push_back(total);
      total += (t.bytes + 15) / 16 * 16;
    }
    Status s = fusion_buffer(total);
    if (!s.ok()) return s;
    std::vector<Segment> into;
    for (size_t i = 0; i < o.segments.size(); ++i) {
      const Segment& t = o.segments[i];
      into.push_back({t.input, fusion_ + at[i], t.bytes});
      unpack->push_back({fusion_ + at[i], t.output, t.bytes});
    }
    *buffer = fusion_;
    *count = total / element;
    if (spec.prescale == 1.0) return kernels_.copy(into, stream_);
    for (size_t i = 0; s.ok() && i < into.size(); ++i)
      s = kernels_.prescale(spec.dtype, into[i].output, into[i].input, into[i].bytes / element, spec.prescale, stream_);
    return s;
  }

  // The hierarchical allreduce of `buffer` in place (see the top of the
  // file). Chunk l is elements [first[l], first[l+1]); local ranks past the
  // cross groups (uneven hosts) have empty chunks.
  Status hierarchical_allreduce(const ReduceSpec& spec, int type, int op, char* buffer, uint64_t count) {
    const size_t element = dtype_size(spec.dtype);
    const int local_size = (int)layout_.communicator.size();
    const uint64_t groups = layout_.cross_groups.size();
    std::vector<uint64_t> first(local_size + 1, count);
    for (int l = 0; l < local_size && (uint64_t)l < groups; ++l) first[l] = count * l / groups;
    auto chunk = [&](int l) { return buffer + first[l] * element; };
    auto length = [&](int l) { return first[l + 1] - first[l]; };
    Status s;
    if (local_size > 1) s = grouped([&] {
      Status s;
      for (int l = 0; s.ok() && l < local_size; ++l)
        if (length(l) > 0)
          s = nccl_.check(nccl_.Reduce(chunk(l), chunk(l), length(l), type, op, l, comm_, stream_), "ncclReduce");
      return s;
    });
    const int me = local_rank_;
    if (s.ok() && cross_ != nullptr && length(me) > 0) {
      // Sums across hosts; the division and the postscale are the job's,
      // done once below.
      ReduceSpec across = spec;
      across.prescale = across.postscale = 1.0;
      if (across.reduce_op == UNISON_AVERAGE) across.reduce_op = UNISON_SUM;
      across.ranks = 1;
      AllreduceOptions mine{{{chunk(me), chunk(me), length(me) * element}}, across};
      s = stage_allreduce(mine, cross_.get());
    }
    if (s.ok() && length(me) > 0) s = finish(spec, chunk(me), length(me));
    if (s.ok() && local_size > 1) s = grouped([&] {
      Status s;
      for (int l = 0; s.ok() && l < local_size; ++l)
        if (length(l) > 0)
          s = nccl_.check(nccl_.Broadcast(chunk(l), chunk(l), length(l) * element, NcclLibrary::kUint8, l, comm_,
                                          stream_),
                          "ncclBroadcast");
      return s;
    });
    return s;
  }

  // Grows the fusion buffer to `bytes`; it is kept for the plane's life.
  Status fusion_buffer(size_t bytes) {
    if (bytes <= fusion_bytes_) return Status::OK();
    if (fusion_ != nullptr) cuda_.Free(fusion_);  // waits for the work that uses it
    fusion_ = nullptr;
    fusion_bytes_ = 0;
    void* memory = nullptr;
    Status s = cuda_.check(cuda_.Malloc(&memory, bytes), "allocating a " + std::to_string(bytes) +
                                                             "-byte device fusion buffer");
    if (!s.ok()) return s;
    fusion_ = static_cast<char*>(memory);
    fusion_bytes_ = bytes;
    return s;
  }

  const NcclLibrary& nccl_;
  const NcclLayout layout_;
  int local_rank_ = 0;                // this rank's place in the communicator
  std::unique_ptr<Backend> cross_;    // hierarchical: this rank's cross group, if it is in one
  ncclComm_t comm_ = nullptr;
  char* fusion_ = nullptr;
  size_t fusion_bytes_ = 0;
};

}  // namespace

Status make_nccl_plane(const CudaRuntime& cuda, int device, Backend* host, const NcclLayout& layout,
                       std::unique_ptr<DevicePlane>* out) {
  const NcclLibrary* nccl = nccl_library();
  if (nccl == nullptr) return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + nccl_missing());
  auto plane = std::make_unique<NcclPlane>(cuda, device, host, *nccl, layout);
  Status s = plane->init();
  if (!s.ok()) return s;
  *out = std::move(plane);
  return s;
}

}  // namespace unison
