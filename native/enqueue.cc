// enqueue.cc: the calling side of the engine. Turns a caller's C options
// into a Request, checking everything one rank can check alone, and queues
// it for the next negotiation cycle.
#include "engine.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "caller_activity.h"
#include "cuda/runtime.h"
#include "dtype.h"

namespace unison {
namespace {

// Rows of a reducescatter's first dimension that `rank` receives: as even
// as possible, the first ranks taking one more when it does not divide.
int64_t scatter_rows(int64_t rows, int size, int rank) {
  return rows / size + (rank < rows % size ? 1 : 0);
}

// "[0, 2]"
std::string set_string(const std::vector<int>& ranks) {
  return shape_string(std::vector<int64_t>(ranks.begin(), ranks.end()));
}

Status invalid(const std::string& message) {
  return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: " + message);
}

// Splits the caller gave (alltoall's rows sent, reducescatter's rows
// received): one per rank, none negative, adding up to the tensor's rows.
template <typename What>
Status given_splits(const unison_op_options& o, int size, int64_t rows, const What& what, std::vector<int64_t>* out) {
  if (o.nsplits != size)
    return invalid(what() + ": got " + std::to_string(o.nsplits) + " splits for " + std::to_string(size) + " ranks");
  out->assign(o.splits, o.splits + o.nsplits);
  // Added without wrapping: splits whose sum wraps around to the row count
  // ([2^63 - 1, 2^63 - 1, 6] for 4 rows) would pass, and the collective
  // would then write far past its buffers.
  int64_t total = 0;
  bool past_int64 = false;
  for (int64_t s : *out) {
    if (s < 0) return invalid(what() + ": negative split in " + shape_string(*out));
    past_int64 |= __builtin_add_overflow(total, s, &total);
  }
  if (past_int64 || total != rows)
    return invalid(what() + ": splits " + shape_string(*out) + " add up to " +
                   (past_int64 ? std::string("more than 2^63 - 1") : std::to_string(total)) + " rows, the tensor has " +
                   std::to_string(rows));
  return Status::OK();
}

}  // namespace

// ---- the calling side ---------------------------------------------------------

Status Engine::enqueue(const unison_op_options& o, int64_t* handle) {
  Entry e;
  Request& r = e.request;
  const int my_rank = backend_->rank();
  r.rank = my_rank;
  r.op = o.op;
  r.dtype = o.dtype;
  r.reduce_op = o.reduce_op;
  r.prescale = o.prescale_factor == 0.0 ? 1.0 : o.prescale_factor;
  r.postscale = o.postscale_factor == 0.0 ? 1.0 : o.postscale_factor;
  r.root = o.root_rank;
  r.device = o.device;
  r.placeholder = o.placeholder != 0;
  e.process_set = o.process_set_id;
  e.input = o.input;
  e.output = o.output;
  e.output_bytes = o.output_bytes;
  e.input_ready = o.input_ready;

  if (o.op < UNISON_ALLREDUCE || o.op > UNISON_REMOVE_PROCESS_SET) return invalid("unknown op " + std::to_string(o.op));
  // Built only for an error message: this function runs once per tensor.
  auto what = [&o] {
    return std::string(op_name(o.op)) + (o.name != nullptr && *o.name ? std::string(" '") + o.name + "'" : "");
  };
  // The set the op runs among: its size, and this rank's place in it.
  int size = backend_->size();
  std::vector<int> members;
  if (o.process_set_id != UNISON_GLOBAL_PROCESS_SET) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      auto it = set_ranks_.find(o.process_set_id);
      if (it != set_ranks_.end()) members = it->second;
    }
    if (members.empty())
      return invalid(what() + ": process set " + std::to_string(o.process_set_id) +
                     " does not exist (never added, or removed)");
    auto me = std::find(members.begin(), members.end(), my_rank);
    if (me == members.end())
      return invalid(what() + ": rank " + std::to_string(my_rank) + " is not in process set " +
                     std::to_string(o.process_set_id) + " (ranks " + set_string(members) + ")");
    if (o.op == UNISON_JOIN || o.op == UNISON_ADD_PROCESS_SET || o.op == UNISON_REMOVE_PROCESS_SET)
      return invalid(what() + ": runs on the global process set only");
    r.rank = (int)(me - members.begin());
    size = (int)members.size();
  }

  const bool carries_tensor = o.op <= UNISON_REDUCESCATTER;
  if (carries_tensor) {
    if (!dtype_valid(o.dtype)) return invalid(what() + ": unsupported dtype code " + std::to_string(o.dtype));
    if (o.ndim < 0 || o.ndim > UNISON_MAX_DIMS)
      return invalid(what() + ": ndim " + std::to_string(o.ndim) + " is outside 0.." + std::to_string(UNISON_MAX_DIMS));
    if (o.ndim > 0 && o.shape == nullptr) return invalid(what() + ": shape is NULL");
    r.shape.assign(o.shape, o.shape + o.ndim);
    for (int64_t d : r.shape)
      if (d < 0) return invalid(what() + ": negative size in shape " + shape_string(r.shape));
    const int64_t elements = element_count(r.shape);
    if (elements > 0 && (size_t)elements > (SIZE_MAX / 4) / dtype_size(o.dtype))
      return invalid(what() + ": shape " + shape_string(r.shape) + " is too large");
    const size_t bytes = (size_t)elements * dtype_size(o.dtype);
    const bool needs_input = o.op != UNISON_BROADCAST || o.root_rank == my_rank;
    if (bytes > 0 && needs_input && o.input == nullptr) return invalid(what() + ": input pointer is NULL");
    if (bytes > 0 && (o.op == UNISON_ALLREDUCE || o.op == UNISON_BROADCAST) && o.output == nullptr)
      return invalid(what() + ": output pointer is NULL");
    if ((o.op == UNISON_ALLGATHER || o.op == UNISON_ALLTOALL || o.op == UNISON_REDUCESCATTER) && o.ndim == 0)
      return invalid(what() + ": needs a tensor with at least one dimension, got a scalar");
  }
  if (o.placeholder != 0 && o.op != UNISON_ALLREDUCE && o.op != UNISON_REDUCESCATTER)
    return invalid(what() + ": only an allreduce or a reducescatter takes a placeholder contribution");
  if (o.op == UNISON_ALLREDUCE || o.op == UNISON_REDUCESCATTER) {
    if (o.reduce_op < UNISON_SUM || o.reduce_op > UNISON_ADASUM)
      return invalid(what() + ": unknown reduce op " + std::to_string(o.reduce_op));
    if (o.reduce_op == UNISON_ADASUM) {
      // Adasum weighs whole gradients by their dot products: it needs
      // real numbers, and the scale factors would change those weights.
      if (o.op == UNISON_REDUCESCATTER) return invalid(what() + ": reducescatter does not take Adasum");
      if (!dtype_is_float(o.dtype))
        return invalid(what() + ": Adasum needs a floating-point tensor, got " + dtype_name(o.dtype));
      if (r.prescale != 1.0 || r.postscale != 1.0)
        return invalid(what() + ": Adasum takes no prescale or postscale factor");
    }
    // Part by part, Sum and Average are a complex number's; Min, Max and
    // Product are not (complex numbers have no order, and a product mixes
    // the parts), so they are refused rather than computed wrongly.
    if (dtype_is_complex(o.dtype) && o.reduce_op != UNISON_SUM && o.reduce_op != UNISON_AVERAGE)
      return invalid(what() + ": " + dtype_name(o.dtype) + " tensors reduce by Sum or Average, not " +
                     reduce_op_name(o.reduce_op));
    if (o.dtype == UNISON_BOOL && (o.reduce_op == UNISON_AVERAGE || r.prescale != 1.0 || r.postscale != 1.0))
      return invalid(what() + ": bool tensors support Sum (any), Max (any), Min (all) and Product (all) without scale factors");
  }
  if (o.op == UNISON_BROADCAST) {
    // The root is named by its global rank, as in Horovod; it travels as
    // its place in the set.
    if (o.root_rank < 0 || o.root_rank >= backend_->size())
      return invalid(what() + ": root rank " + std::to_string(o.root_rank) + " is outside 0.." +
                     std::to_string(backend_->size() - 1));
    if (!members.empty()) {
      auto root = std::find(members.begin(), members.end(), o.root_rank);
      if (root == members.end())
        return invalid(what() + ": root rank " + std::to_string(o.root_rank) + " is not in process set " +
                       std::to_string(o.process_set_id) + " (ranks " + set_string(members) + ")");
      r.root = (int)(root - members.begin());
    }
  }
  if (o.op == UNISON_ALLTOALL) {
    const int64_t rows = r.shape[0];
    if (o.splits == nullptr) {
      if (rows % size != 0)
        return invalid(what() + ": first dimension " + std::to_string(rows) + " does not divide evenly among " +
                       std::to_string(size) + " ranks; pass splits");
      r.splits.assign(size, rows / size);
    } else {
      Status s = given_splits(o, size, rows, what, &r.splits);
      if (!s.ok()) return s;
    }
  }
  if (o.op == UNISON_REDUCESCATTER) {
    // Even splits are written out, so a rank that passes them explicitly
    // agrees with one that does not.
    const int64_t rows = r.shape[0];
    if (o.splits == nullptr) {
      for (int p = 0; p < size; ++p) r.splits.push_back(scatter_rows(rows, size, p));
    } else {
      Status s = given_splits(o, size, rows, what, &r.splits);
      if (!s.ok()) return s;
    }
  }
  if (o.op == UNISON_ADD_PROCESS_SET) {
    if (o.splits == nullptr || o.nsplits < 1) return invalid(what() + ": a process set needs at least one rank");
    r.splits.assign(o.splits, o.splits + o.nsplits);
    for (size_t i = 0; i < r.splits.size(); ++i)
      if (r.splits[i] < 0 || r.splits[i] >= size || (i > 0 && r.splits[i] <= r.splits[i - 1]))
        return invalid(what() + ": ranks " + shape_string(r.splits) + " must be distinct, ascending and within 0.." +
                       std::to_string(size - 1));
    std::lock_guard<std::mutex> lock(queue_mutex_);
    for (const auto& [id, ranks] : set_ranks_)
      if (std::equal(ranks.begin(), ranks.end(), r.splits.begin(), r.splits.end()))
        return invalid(what() + ": process set " + std::to_string(id) + " already has ranks " + shape_string(r.splits));
  }
  if (o.op == UNISON_REMOVE_PROCESS_SET) {
    if (o.root_rank == UNISON_GLOBAL_PROCESS_SET) return invalid(what() + ": the global process set cannot be removed");
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (!set_ranks_.count(o.root_rank))
      return invalid(what() + ": process set " + std::to_string(o.root_rank) + " does not exist (never added, or removed)");
  }
  if (o.device != UNISON_CPU_DEVICE && carries_tensor) {
    Status s = accept_device_op(o, what(), &e);
    if (!s.ok()) return s;
    // Ranks may each use their own GPU: negotiation compares only whether
    // a tensor is on a GPU at all.
    r.device = 0;
  }

  std::lock_guard<std::mutex> lock(queue_mutex_);
  if (!terminal_.ok()) return terminal_;
  if (o.name != nullptr && *o.name != '\0') {
    r.name = o.name;
  } else if (o.op == UNISON_JOIN) {
    r.name = "join";
  } else {
    r.name = std::string(op_name(o.op)) + ".noname." + std::to_string(++unnamed_ops_[o.process_set_id]);
  }
  // One hash of the name: the insert is the check.
  if (!mark_in_flight(o.process_set_id, r.name))
    return invalid(std::string(op_name(o.op)) + " '" + r.name + "': a tensor of this name is already in flight on rank " +
                   std::to_string(my_rank) + "; wait for it, or give the new one another name");
  e.handle = handles_->create(o.awaited_by);
  *handle = e.handle;
  timeline_.begin(r.name, "QUEUED");
  const double now = monotonic_seconds();
  caller_activity::note_enqueue(now, o.awaited_by != 0);
  if (carries_tensor) {
    auto group = open_groups_.find(std::this_thread::get_id());
    if (group != open_groups_.end()) {
      group->second.held.push_back(std::move(e));
      return Status::OK();
    }
  }
  queue_for_cycle(std::move(e), now);
  wake_for(*handle);
  return Status::OK();
}

bool Engine::mark_in_flight(int process_set, const std::string& name) {
  NameSet& names = in_flight_[process_set];
  NameSet::node_type node = spare_in_flight_.take();
  if (node.empty()) return names.insert(name).second;
  node.value() = name;  // into the kept string's memory
  auto placed = names.insert(std::move(node));
  if (!placed.inserted) spare_in_flight_.keep(std::move(placed.node));
  return placed.inserted;
}

void Engine::unmark_in_flight(int process_set, const std::string& name) {
  auto names = in_flight_.find(process_set);
  if (names == in_flight_.end()) return;
  auto it = names->second.find(name);
  if (it != names->second.end()) spare_in_flight_.erase(names->second, it);
}

void Engine::queue_for_cycle(Entry&& e, double now) {
  last_enqueued_at_ = now;
  if (queue_.empty()) queued_since_ = now;
  queue_.push_back(std::move(e));
}

Status Engine::accept_device_op(const unison_op_options& o, const std::string& what, Entry* e) {
  const CudaRuntime* cuda = cuda_runtime();
  if (cuda == nullptr)
    return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + what + ": the tensor is on GPU " + std::to_string(o.device) +
                                                     ", but this process cannot use CUDA: " + cuda_missing());
  if (o.device < 0 || o.device >= cuda->devices)
    return invalid(what + ": device " + std::to_string(o.device) + " is outside 0.." + std::to_string(cuda->devices - 1));
  DeviceGuard guard(*cuda, o.device);
  // A host pointer given as device memory would be read by the GPU as
  // garbage, or fault it: refuse it here, where the caller can be told.
  const bool has_data = element_count(e->request.shape) > 0;
  const std::pair<const char*, const void*> pointers[] = {{"input", o.input}, {"output", o.output}};
  // A ragged op's output with no capacity is never written (the op fails
  // on this rank as too small): it may be any placeholder.
  const bool output_used = o.op == UNISON_ALLREDUCE || o.op == UNISON_BROADCAST || o.output_bytes > 0;
  for (const auto& [which, pointer] : pointers) {
    if (pointer == nullptr || !has_data || (pointer == o.output && !output_used)) continue;
    CudaRuntime::PointerAttributes a{};
    if (cuda->PointerGetAttributes(&a, pointer) != 0 ||
        (a.type != CudaRuntime::kMemoryTypeDevice && a.type != CudaRuntime::kMemoryTypeManaged))
      return invalid(what + ": the " + which + " is not device memory, but device " + std::to_string(o.device) +
                     " was given");
    if (a.type == CudaRuntime::kMemoryTypeDevice && a.device != o.device)
      return invalid(what + ": the " + which + " is on GPU " + std::to_string(a.device) + ", but device " +
                     std::to_string(o.device) + " was given");
  }
  void* event = take_event(*cuda, o.device);
  if (event == nullptr) return Status::Error(UNISON_ERR_INTERNAL, "unison: " + what + ": could not create a CUDA event");
  const int device = o.device;
  e->ready = std::shared_ptr<void>(event, [device](void* used) { give_event(device, used); });
  Status s = cuda->check(cuda->EventRecord(event, o.stream), what + ": recording an event on the caller's stream");
  if (!s.ok()) return s;
  e->device = o.device;
  e->stream = o.stream;
  return Status::OK();
}

// ---- groups: ops enqueued together ---------------------------------------------
//
// Why. A grouped call (grouped_allreduce, broadcast of a model's
// parameters) enqueues its tensors one by one. Where the engine's thread
// takes ops as they arrive (it has a core of its own, UNISON_OVERLAP), a
// cycle could start after the first few and run the rest in later cycles,
// unfused: 200 small tensors on a GPU became 200 NCCL calls. Held back
// and queued at once, the group reaches negotiation whole on every rank,
// as Horovod's grouped ops do. Barriers, joins and process-set changes are
// never held: their callers wait for them at once.

void Engine::group_begin() {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  OpenGroup& group = open_groups_[std::this_thread::get_id()];
  if (group.depth++ == 0) group.held.swap(spare_held_);
}

void Engine::group_end(bool discard) {
  std::vector<Entry> held;
  Status terminal;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    auto group = open_groups_.find(std::this_thread::get_id());
    if (group == open_groups_.end()) return;
    group->second.discard |= discard;
    if (--group->second.depth > 0) return;
    discard = group->second.discard;
    held = std::move(group->second.held);
    open_groups_.erase(group);
    if (!held.empty() && !discard && terminal_.ok()) {
      const double now = monotonic_seconds();
      const int64_t last = held.back().handle;
      for (Entry& e : held) queue_for_cycle(std::move(e), now);
      wake_for(last);
      held.clear();
      if (held.capacity() > spare_held_.capacity()) spare_held_.swap(held);
      return;
    }
    for (const Entry& e : held) unmark_in_flight(e.process_set, e.request.name);
    terminal = terminal_;
  }
  // Discarded (the caller's group failed part way) or too late to run.
  for (const Entry& e : held) {
    timeline_.end(e.request.name, "QUEUED");
    handles_->complete(e.handle, !terminal.ok() ? terminal
                                                : Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                                                                "unison: " + std::string(op_name(e.request.op)) + " '" +
                                                                    e.request.name + "' was not started: its group was "
                                                                    "abandoned when another of its ops was refused"));
  }
}

}  // namespace unison
