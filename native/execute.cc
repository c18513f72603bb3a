// execute.cc: fusing the responses of a cycle into groups and running each
// group on its data plane.
#include "engine.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <tuple>

#include "adasum.h"
#include "copy.h"
#include "dtype.h"

namespace unison {
namespace {

Status invalid(const std::string& message) {
  return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: " + message);
}

// Where an op's output goes: the caller's buffer, or one the core
// allocates because only negotiation could tell its size. A caller's buffer
// too small for what negotiation decided is not written past: the
// collective still runs (the other ranks are in it) into a buffer of the
// core's, and `overflow` says why this rank's op fails. `memory` gets the
// core's buffer: host or device memory, where the tensors are.
template <typename Memory>
void* output_buffer(Memory& memory, void* caller_output, int64_t capacity, size_t bytes, OpResult* result,
                    std::string* overflow = nullptr) {
  result->bytes = (int64_t)bytes;
  if (caller_output != nullptr && (overflow == nullptr || bytes <= (size_t)std::max<int64_t>(capacity, 0))) {
    result->data = caller_output;
    return caller_output;
  }
  if (caller_output != nullptr)
    *overflow = "the output holds " + std::to_string(capacity) + " bytes, the result needs " + std::to_string(bytes);
  result->data = memory.result(bytes);
  result->core_allocated = true;
  return result->data;
}

// Where one group's buffers live. Host memory for CPU tensors; for GPU
// tensors, the plane's device memory and its stream. The first failure to
// get device memory is kept, and the group fails with it.
class GroupMemory {
 public:
  explicit GroupMemory(DevicePlane* plane) : plane_(plane) {}
  ~GroupMemory() {
    if (plane_ != nullptr) plane_->end_group();
  }

  // A result buffer the caller takes over (unison_free frees either kind).
  void* result(size_t bytes) {
    if (plane_ != nullptr) return device(plane_->allocate_result(bytes, &last_));
    // 64-byte aligned, so frameworks can adopt the buffer without a copy
    // (TensorFlow takes only buffers aligned for its widest vector loads).
    constexpr size_t kAlign = 64;
    void* data = bytes <= SIZE_MAX - kAlign
                     ? std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + (bytes == 0 ? kAlign : 0))
                     : nullptr;
    if (data == nullptr && failure_.ok())
      failure_ = Status::Error(UNISON_ERR_OUT_OF_MEMORY,
                               "unison: cannot allocate " + std::to_string(bytes) + " bytes for the result");
    return data;
  }

  // Zeroed scratch that lives as long as the group: what a joined rank
  // contributes.
  char* zeros(size_t bytes) {
    if (plane_ != nullptr) return static_cast<char*>(device(plane_->zeros(bytes, &last_)));
    host_scratch_.emplace_back(bytes > 0 ? bytes : 1, 0);
    return host_scratch_.back().data();
  }

  void copy(void* to, const void* from, size_t bytes) {
    if (plane_ == nullptr) {
      copy_bytes(to, from, bytes);
    } else {
      Status s = plane_->copy(to, from, bytes);
      if (failure_.ok()) failure_ = s;
    }
  }

  const Status& failure() const { return failure_; }

 private:
  void* device(const Status& s) {
    if (!s.ok() && failure_.ok()) failure_ = s;
    return s.ok() ? last_ : nullptr;
  }
  DevicePlane* plane_;
  void* last_ = nullptr;
  Status failure_;
  std::vector<std::vector<char>> host_scratch_;
};

}  // namespace

// ---- fusion and execution -------------------------------------------------------

std::vector<std::vector<const Response*>> Engine::fuse(const ProcessSetState& set,
                                                       const std::vector<const Response*>& responses) const {
  // Compatible responses share a group until it would pass the threshold.
  // The grouping depends only on the list, which every rank has the same.
  using Key = std::tuple<int, int, int, double, double, int>;
  std::vector<std::vector<const Response*>> groups;
  std::map<Key, std::pair<size_t, size_t>> open;  // key -> (group index, bytes)
  const int size = set.size();
  for (const Response* response : responses) {
    const Response& r = *response;
    const bool fusable = !r.is_error() && (r.op == UNISON_ALLREDUCE || r.op == UNISON_ALLGATHER ||
                                           r.op == UNISON_REDUCESCATTER);
    if (!fusable) {
      groups.push_back({&r});
      continue;
    }
    const TensorPlan& t = r.tensors[0];
    size_t bytes = (size_t)element_count(t.shape) * dtype_size(r.dtype);
    if (r.op == UNISON_ALLGATHER) {
      bytes = 0;
      for (int p = 0; p < size; ++p) bytes += (size_t)t.first_dims[p] * row_bytes(t.shape, r.dtype);
    }
    // Allgather moves bytes and never looks at them, so any dtypes fuse.
    Key key = r.op == UNISON_ALLGATHER ? Key(r.op, 0, 0, 0, 0, r.device)
                                       : Key(r.op, r.dtype, r.reduce_op, r.prescale, r.postscale, r.device);
    auto it = open.find(key);
    if (it != open.end() && it->second.second + bytes <= tuned_.fusion_threshold_bytes) {
      groups[it->second.first].push_back(&r);
      it->second.second += bytes;
    } else {
      open[key] = {groups.size(), bytes};
      groups.push_back({&r});
    }
  }
  return groups;
}

namespace {

std::string upper(std::string text) {
  for (char& c : text) c = (char)std::toupper((unsigned char)c);
  return text;
}

// The timeline's spans of one collective on rank 0: each of its tensors ends
// NEGOTIATE (naming the ranks it waited for) and spends the collective in a
// span named by the backend; the backend's own phases go on the group's row.
class CollectiveSpans {
 public:
  template <typename IsLocal>
  CollectiveSpans(Timeline& timeline, const DataPlane& plane, const std::vector<const Response*>& group,
                  IsLocal is_local)
      : timeline_(timeline) {
    if (!timeline.active()) return;
    size_t bytes = 0;
    for (const Response* response : group) {
      const TensorPlan& t = response->tensors[0];
      bytes += (size_t)element_count(t.shape) * dtype_size(response->dtype);
      if (is_local(t.name)) names_.push_back(t.name);
    }
    if (names_.empty()) return;
    phase_ = upper(plane.name()) + "_" + upper(op_name(group[0]->op));
    row_ = "group " + names_[0] + (group.size() > 1 ? " (+" + std::to_string(group.size() - 1) + ")" : "");
    const std::string args = "\"group\":" + json_string(row_) + ",\"tensors\":" + std::to_string(group.size()) +
                             ",\"bytes\":" + std::to_string(bytes);
    for (const std::string& name : names_) {
      timeline.end(name, "NEGOTIATE", "\"waited_for\":" + timeline.waited_for(name));
      timeline.begin(name, phase_, args);
    }
    timeline.begin(row_, phase_, args);
    set_timeline_group(&timeline, &row_);
  }

  ~CollectiveSpans() {
    if (names_.empty()) return;
    set_timeline_group(nullptr, nullptr);
    timeline_.end(row_, phase_);
    for (const std::string& name : names_) timeline_.end(name, phase_);
  }

 private:
  Timeline& timeline_;
  std::vector<std::string> names_;  // the group's tensors this rank has
  std::string phase_, row_;
};

}  // namespace

void Engine::execute(ProcessSetState& set, const std::vector<const Response*>& group) {
  const Response& head = *group[0];
  const int size = set.size();
  const int rank = set.rank;
  if (head.is_error()) {
    timeline_.end(head.tensors[0].name, "NEGOTIATE", "\"error\":" + json_string(head.error));
    complete(set, head.tensors[0].name, Status::Error(head.error_code, head.error));
    return;
  }
  auto local = [&](const std::string& name) -> Entry* {
    auto it = set.pending.find(name);
    return it == set.pending.end() ? nullptr : &it->second;
  };
  // GPU tensors run on the set's plane for their device, with that device
  // current, after the kernels that produced them.
  DevicePlane* plane = nullptr;
  std::optional<DeviceGuard> device_guard;
  if (head.device != UNISON_CPU_DEVICE && head.op <= UNISON_REDUCESCATTER) {
    int device = -1;  // a joined rank has no tensor to say which
    for (const Response* r : group)
      if (Entry* e = local(r->tensors[0].name)) device = e->device;
    Status s = device_plane(set, device, &plane);
    for (const Response* r : group)
      if (Entry* e = local(r->tensors[0].name); s.ok() && e != nullptr) s = plane->wait_for(e->ready.get());
    if (!s.ok()) {
      for (const Response* r : group) complete(set, r->tensors[0].name, s);
      return;
    }
    device_guard.emplace(*cuda_runtime(), plane->device());
  }
  // Host tensors run on the set's own backend.
  DataPlane* const data = plane != nullptr ? static_cast<DataPlane*>(plane) : set.backend;
  CollectiveSpans spans(timeline_, *data, group, [&](const std::string& name) { return local(name) != nullptr; });
  // A rank that has joined has no tensors of its own: it contributes zeros
  // (or nothing) from scratch memory and drops what it receives.
  GroupMemory memory(plane);
  auto zeros = [&](size_t bytes) { return memory.zeros(bytes); };
  std::vector<OpResult> results(group.size());
  std::vector<std::string> overflow(group.size());  // why a caller's output was too small
  Status status;

  switch (head.op) {
    case UNISON_ALLREDUCE: {
      AllreduceOptions o;
      o.reduce = ReduceSpec{reduced_as(head.dtype), head.reduce_op, head.prescale, head.postscale, size};
      for (size_t i = 0; i < group.size(); ++i) {
        const TensorPlan& t = group[i]->tensors[0];
        const size_t bytes = (size_t)element_count(t.shape) * dtype_size(head.dtype);
        Entry* e = local(t.name);
        if (e != nullptr) {
          results[i].data = e->output;
          results[i].bytes = (int64_t)bytes;
          results[i].shape = t.shape;
          results[i].unused_everywhere = group[i]->unused_everywhere;
          o.segments.push_back({e->input, e->output, bytes});
        } else {
          char* z = zeros(bytes);
          o.segments.push_back({z, z, bytes});
        }
      }
      if (!memory.failure().ok())
        status = memory.failure();
      else if (head.reduce_op != UNISON_ADASUM)
        status = data->allreduce(o);
      else
        status = plane != nullptr ? plane->adasum(head.dtype, o.segments)
                                  : adasum_allreduce(*data, head.dtype, o.segments);
      break;
    }
    case UNISON_ALLGATHER: {
      AllgatherOptions o;
      for (size_t i = 0; i < group.size(); ++i) {
        const TensorPlan& t = group[i]->tensors[0];
        Entry* e = local(t.name);
        const size_t row = row_bytes(t.shape, group[i]->dtype);
        AllgatherOptions::Tensor part;
        size_t total = 0;
        int64_t rows = 0;
        for (int p = 0; p < size; ++p) {
          part.bytes_per_rank.push_back((size_t)t.first_dims[p] * row);
          total += part.bytes_per_rank.back();
          rows += t.first_dims[p];
        }
        part.input = e != nullptr ? e->input : nullptr;
        part.output = e != nullptr ? output_buffer(memory, e->output, e->output_bytes, total, &results[i], &overflow[i])
                                   : output_buffer(memory, nullptr, 0, total, &results[i]);
        results[i].shape = t.shape;
        results[i].shape[0] = rows;
        o.tensors.push_back(part);
      }
      status = memory.failure().ok() ? data->allgather(o) : memory.failure();
      break;
    }
    case UNISON_BROADCAST: {
      const TensorPlan& t = head.tensors[0];
      Entry* e = local(t.name);
      const size_t bytes = (size_t)element_count(t.shape) * dtype_size(head.dtype);
      void* buffer = e != nullptr ? output_buffer(memory, e->output, 0, bytes, &results[0]) : zeros(bytes);
      if (e != nullptr && rank == head.root && bytes > 0 && buffer != e->input) memory.copy(buffer, e->input, bytes);
      results[0].shape = t.shape;
      status = memory.failure().ok() ? data->broadcast(BroadcastOptions{buffer, bytes, head.root}) : memory.failure();
      break;
    }
    case UNISON_ALLTOALL: {
      const TensorPlan& t = head.tensors[0];
      Entry* e = local(t.name);
      const size_t row = row_bytes(t.shape, head.dtype);
      AlltoallOptions o;
      int64_t rows_in = 0;
      results[0].received_splits.assign(size, 0);
      for (int sender = 0; sender < size; ++sender) {
        for (int receiver = 0; receiver < size; ++receiver)
          o.bytes.push_back((size_t)t.splits[(size_t)sender * size + receiver] * row);
        results[0].received_splits[sender] = t.splits[(size_t)sender * size + rank];
        rows_in += results[0].received_splits[sender];
      }
      o.input = e != nullptr ? e->input : nullptr;
      o.output = e != nullptr ? output_buffer(memory, e->output, e->output_bytes, (size_t)rows_in * row, &results[0], &overflow[0])
                              : output_buffer(memory, nullptr, 0, (size_t)rows_in * row, &results[0]);
      results[0].shape = t.shape;
      results[0].shape[0] = rows_in;
      status = memory.failure().ok() ? data->alltoall(o) : memory.failure();
      break;
    }
    case UNISON_REDUCESCATTER: {
      ReducescatterOptions o;
      o.reduce = ReduceSpec{reduced_as(head.dtype), head.reduce_op, head.prescale, head.postscale, size};
      for (size_t i = 0; i < group.size(); ++i) {
        const TensorPlan& t = group[i]->tensors[0];
        Entry* e = local(t.name);
        const size_t row = row_bytes(t.shape, head.dtype);
        ReducescatterOptions::Tensor part;
        for (int p = 0; p < size; ++p) part.bytes_per_rank.push_back((size_t)t.splits[p] * row);
        const size_t total = (size_t)element_count(t.shape) * dtype_size(head.dtype);
        part.input = e != nullptr ? e->input : zeros(total);
        part.output = e != nullptr ? output_buffer(memory, e->output, e->output_bytes, part.bytes_per_rank[rank], &results[i], &overflow[i])
                                   : output_buffer(memory, nullptr, 0, part.bytes_per_rank[rank], &results[i]);
        results[i].shape = t.shape;
        results[i].shape[0] = t.splits[rank];
        results[i].unused_everywhere = group[i]->unused_everywhere;
        o.tensors.push_back(part);
      }
      status = memory.failure().ok() ? data->reducescatter(o) : memory.failure();
      break;
    }
    case UNISON_BARRIER:
      break;  // every rank reached it: negotiation was the barrier
    case UNISON_JOIN:
      joined_ = false;
      results[0].join_rank = head.last_joined_rank;
      break;
    case UNISON_ADD_PROCESS_SET:
      status = add_process_set(std::vector<int>(head.tensors[0].splits.begin(), head.tensors[0].splits.end()),
                               &results[0]);
      break;
    case UNISON_REMOVE_PROCESS_SET:
      remove_process_set(head.root);
      break;
  }

  if (tuner_ != nullptr && &set == global_ && head.op == UNISON_ALLREDUCE && status.ok()) {
    const double now = monotonic_seconds();
    for (const Response* r : group)
      tuner_->executed(r->tensors[0].name, (size_t)element_count(r->tensors[0].shape) * dtype_size(r->dtype), now);
  }
  if (plane != nullptr && status.ok()) {
    // The callers' streams go on once the plane's work is done: the handles
    // complete now, and their results are ready in stream order.
    std::vector<void*> streams;
    for (const Response* r : group)
      if (Entry* e = local(r->tensors[0].name); e != nullptr && std::find(streams.begin(), streams.end(), e->stream) == streams.end())
        streams.push_back(e->stream);
    status = plane->release_to(streams);
  }
  for (size_t i = 0; i < group.size(); ++i) {
    const std::string& name = group[i]->tensors[0].name;
    if ((local(name) == nullptr || !overflow[i].empty()) && results[i].core_allocated) {
      free_result_memory(results[i].data);
      results[i] = OpResult();
    }
    if (local(name) == nullptr) continue;
    if (status.ok() && !overflow[i].empty())
      complete(set, name, invalid(std::string(op_name(head.op)) + " '" + name + "': " + overflow[i]));
    else
      complete(set, name, status, std::move(results[i]));
  }
  if (!status.ok()) fail_everything(status);
}

}  // namespace unison
