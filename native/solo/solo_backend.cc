// The single-process backend: a null object, so that a script run without
// the launcher (rank 0 of 1) goes through the same engine with no
// `if size == 1` anywhere. Every collective is a local copy, with the
// reduction's scaling still applied. Unscaled, a reduction of one rank is
// its input: nothing to do in place, which is every gradient of a script
// run alone. (Reducing them anyway read and wrote every byte: 200 gradients
// of 40 KB took the engine 320 us of a core a step, for nothing.)
#include <atomic>

#include "../backend.h"
#include "../copy.h"
#include "../dtype.h"
#include "../futex.h"

namespace unison {
namespace {

void copy_if_distinct(void* out, const void* in, size_t bytes) {
  if (out != in && bytes > 0) move_bytes(out, in, bytes);
}

// One rank's reduction of `bytes` from `in` into `out`: its input scaled,
// or, unscaled, its input itself (a copy, or nothing in place).
void reduce_alone(const ReduceSpec& spec, const void* in, void* out, size_t bytes) {
  if (spec.prescale == 1.0 && spec.postscale == 1.0) {
    copy_if_distinct(out, in, bytes);
    return;
  }
  const void* inputs[1] = {in};
  reduce(spec, inputs, 1, out, bytes / dtype_size(spec.dtype));
}

class SoloBackend final : public Backend {
 public:
  const char* name() const override { return "solo"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }

  Status exchange(const std::string& mine, std::vector<std::string>* everyone) override {
    everyone->assign(1, mine);
    return Status::OK();
  }
  Status broadcast_message(std::string*, int) override { return Status::OK(); }
  size_t max_message_bytes() const override { return 64u << 20; }

  uint64_t requested_cycles() const override { return requested_.load(); }
  void request_cycles(uint64_t count) override {
    uint64_t seen = requested_.load();
    while (seen < count && !requested_.compare_exchange_weak(seen, count)) {
    }
    doorbell_.ring();
  }
  uint32_t activity_token() const override { return doorbell_.token(); }
  void wait_for_activity(uint32_t token, double timeout_seconds) override {
    doorbell_.sleep(token, timeout_seconds);
  }
  void wake() override { doorbell_.ring(); }
  bool callers_may_drive() const override { return true; }

  Status allreduce(const AllreduceOptions& o) override {
    for (const Segment& s : o.segments) reduce_alone(o.reduce, s.input, s.output, s.bytes);
    return Status::OK();
  }
  Status allgather(const AllgatherOptions& o) override {
    for (const auto& t : o.tensors) copy_if_distinct(t.output, t.input, t.bytes_per_rank[0]);
    return Status::OK();
  }
  Status broadcast(const BroadcastOptions&) override { return Status::OK(); }
  Status alltoall(const AlltoallOptions& o) override {
    copy_if_distinct(o.output, o.input, o.bytes[0]);
    return Status::OK();
  }
  Status reducescatter(const ReducescatterOptions& o) override {
    for (const auto& t : o.tensors) reduce_alone(o.reduce, t.input, t.output, t.bytes_per_rank[0]);
    return Status::OK();
  }
  Status check_peers() override { return Status::OK(); }
  Status split(const std::vector<int>&, int, std::unique_ptr<Backend>* out) override {
    *out = std::make_unique<SoloBackend>();  // the only possible set: {0}
    return Status::OK();
  }

 private:
  std::atomic<uint64_t> requested_{0};
  mutable Doorbell doorbell_;
};

}  // namespace

bool solo_backend_available() { return true; }

Status make_solo_backend(const Config&, int, std::unique_ptr<Backend>* out) {
  *out = std::make_unique<SoloBackend>();
  return Status::OK();
}

}  // namespace unison
