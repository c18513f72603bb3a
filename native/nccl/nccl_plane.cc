// The NCCL plane: collectives on device memory through NCCL, one
// communicator per process set and device. The unique id that NCCL's ranks
// meet by travels over the set's CPU backend.
//
// Allreduce fuses on the device: the group's tensors are copied (or, with a
// prescale, scaled) into one persistent fusion buffer, reduced there in
// place, and copied out; Average and postscale run as a kernel on the
// buffer (../cuda/device_kernels.cu), so results match the CPU path's bits.
// Ragged allgather and reducescatter are grouped broadcasts and reduces,
// since NCCL's own need equal parts; alltoall is grouped sends and
// receives. What NCCL cannot reduce (16-bit integers) is staged through
// host memory like the fallback plane.
#include "../cuda/device_plane.h"
#include "../dtype.h"
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

class NcclPlane : public DevicePlane {
 public:
  NcclPlane(const CudaRuntime& cuda, int device, Backend* host, const NcclLibrary& nccl)
      : DevicePlane(cuda, device, host), nccl_(nccl) {}

  ~NcclPlane() override {
    DeviceGuard guard(cuda_, device_);
    if (stream_ != nullptr) cuda_.StreamSynchronize(stream_);
    if (comm_ != nullptr) nccl_.CommDestroy(comm_);
    if (fusion_ != nullptr) cuda_.Free(fusion_);
  }

  // Collective over the set: rank 0's id reaches everyone by the host backend.
  Status init() {
    if (!ready_.ok()) return ready_;
    ncclUniqueId id;
    if (rank() == 0) {
      Status s = nccl_.check(nccl_.GetUniqueId(&id), "ncclGetUniqueId");
      if (!s.ok()) return s;
    }
    Status s = host_->broadcast(BroadcastOptions{&id, sizeof id, 0});
    if (!s.ok()) return s;
    return nccl_.check(nccl_.CommInitRank(&comm_, size(), id, rank()),
                       "ncclCommInitRank (" + std::to_string(size()) + " ranks)");
  }

  const char* name() const override { return "nccl"; }

  Status allreduce(const AllreduceOptions& o) override {
    int type = 0, op = 0;
    if (!nccl_reduction(o.reduce, &type, &op)) return stage_allreduce(o);
    const ReduceSpec& spec = o.reduce;
    const size_t element = dtype_size(spec.dtype);
    const bool prescale = spec.prescale != 1.0;
    const int divisor = spec.reduce_op == UNISON_AVERAGE ? size() : 1;
    const bool finish = divisor > 1 || spec.postscale != 1.0;
    Status s;
    if (o.segments.size() == 1) {  // no fusion: reduce straight into the output
      const Segment& t = o.segments[0];
      const uint64_t count = t.bytes / element;
      const void* from = t.input;
      if (prescale) {
        s = kernels_.prescale(spec.dtype, t.output, t.input, count, spec.prescale, stream_);
        from = t.output;
      }
      if (s.ok() && count > 0)
        s = nccl_.check(nccl_.AllReduce(from, t.output, count, type, op, comm_, stream_), "ncclAllReduce");
      if (s.ok() && finish) s = kernels_.finish(spec.dtype, t.output, count, divisor, spec.postscale, stream_);
      return s;
    }
    size_t total = 0;
    for (const Segment& t : o.segments) total += t.bytes;
    s = fusion_buffer(total);
    size_t offset = 0;
    for (size_t i = 0; s.ok() && i < o.segments.size(); offset += o.segments[i].bytes, ++i) {
      const Segment& t = o.segments[i];
      s = prescale ? kernels_.prescale(spec.dtype, fusion_ + offset, t.input, t.bytes / element, spec.prescale, stream_)
                   : copy(fusion_ + offset, t.input, t.bytes);
    }
    const uint64_t count = total / element;
    if (s.ok() && count > 0)
      s = nccl_.check(nccl_.AllReduce(fusion_, fusion_, count, type, op, comm_, stream_), "ncclAllReduce");
    if (s.ok() && finish) s = kernels_.finish(spec.dtype, fusion_, count, divisor, spec.postscale, stream_);
    offset = 0;
    for (size_t i = 0; s.ok() && i < o.segments.size(); offset += o.segments[i].bytes, ++i)
      s = copy(o.segments[i].output, fusion_ + offset, o.segments[i].bytes);
    return s;
  }

  Status allgather(const AllgatherOptions& o) override {
    // Rank p's part of each tensor is broadcast from p to its offset in
    // everyone's output; the parts may differ in size.
    Status s = nccl_.check(nccl_.GroupStart(), "ncclGroupStart");
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
    Status ended = nccl_.check(nccl_.GroupEnd(), "ncclGroupEnd");
    return s.ok() ? ended : s;
  }

  Status broadcast(const BroadcastOptions& o) override {
    if (o.bytes == 0) return Status::OK();
    return nccl_.check(nccl_.Broadcast(o.buffer, o.buffer, o.bytes, NcclLibrary::kUint8, o.root, comm_, stream_),
                       "ncclBroadcast");
  }

  Status alltoall(const AlltoallOptions& o) override {
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
    if (s.ok()) s = nccl_.check(nccl_.GroupStart(), "ncclGroupStart");
    if (!s.ok()) return s;
    for (int p = 0; s.ok() && p < n; ++p) {
      if (p == me) continue;
      const size_t out = o.bytes[(size_t)me * n + p], in = o.bytes[(size_t)p * n + me];
      if (out > 0) s = nccl_.check(nccl_.Send(input + send_at[p], out, NcclLibrary::kUint8, p, comm_, stream_), "ncclSend");
      if (s.ok() && in > 0)
        s = nccl_.check(nccl_.Recv(output + receive_at[p], in, NcclLibrary::kUint8, p, comm_, stream_), "ncclRecv");
    }
    Status ended = nccl_.check(nccl_.GroupEnd(), "ncclGroupEnd");
    return s.ok() ? ended : s;
  }

  Status reducescatter(const ReducescatterOptions& o) override {
    int type = 0, op = 0;
    if (!nccl_reduction(o.reduce, &type, &op)) return stage_reducescatter(o);
    const ReduceSpec& spec = o.reduce;
    const size_t element = dtype_size(spec.dtype);
    const int divisor = spec.reduce_op == UNISON_AVERAGE ? size() : 1;
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
      if (s.ok()) s = nccl_.check(nccl_.GroupStart(), "ncclGroupStart");
      size_t offset = 0;
      for (int p = 0; s.ok() && p < size(); offset += t.bytes_per_rank[p], ++p) {
        if (t.bytes_per_rank[p] == 0) continue;
        s = nccl_.check(nccl_.Reduce(from + offset, t.output, t.bytes_per_rank[p] / element, type, op, p, comm_, stream_),
                        "ncclReduce");
      }
      Status ended = nccl_.check(nccl_.GroupEnd(), "ncclGroupEnd");
      if (s.ok()) s = ended;
      if (s.ok() && (divisor > 1 || spec.postscale != 1.0))
        s = kernels_.finish(spec.dtype, t.output, t.bytes_per_rank[rank()] / element, divisor, spec.postscale, stream_);
      if (!s.ok()) return s;
    }
    return s;
  }

 private:
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
  ncclComm_t comm_ = nullptr;
  char* fusion_ = nullptr;
  size_t fusion_bytes_ = 0;
};

}  // namespace

Status make_nccl_plane(const CudaRuntime& cuda, int device, Backend* host, std::unique_ptr<DevicePlane>* out) {
  const NcclLibrary* nccl = nccl_library();
  if (nccl == nullptr) return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + nccl_missing());
  auto plane = std::make_unique<NcclPlane>(cuda, device, host, *nccl);
  Status s = plane->init();
  if (!s.ok()) return s;
  *out = std::move(plane);
  return s;
}

}  // namespace unison
