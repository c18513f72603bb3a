#include "engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <tuple>

#include <pthread.h>

#include "dtype.h"
#include "futex.h"
#include "signals.h"

namespace unison {
namespace {

// How long an idle engine sleeps before it looks at its peers again.
constexpr double kIdleWakeSeconds = 0.25;

// Starts the background thread, named, with asynchronous signals blocked
// (signals.h: they must reach Python's main thread).
std::thread start_engine_thread(std::function<void()> body) {
  std::thread thread;
  {
    AsyncSignalsBlocked blocked;
    thread = std::thread(std::move(body));
  }
  pthread_setname_np(thread.native_handle(), "unison-engine");  // as top -H and gdb show it
  return thread;
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Bytes of one row (everything but the first dimension).
size_t row_bytes(const std::vector<int64_t>& shape, int dtype) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return (size_t)n * dtype_size(dtype);
}

// Rows of a reducescatter's first dimension that `rank` receives: as even
// as possible, the first ranks taking one more when it does not divide.
int64_t scatter_rows(int64_t rows, int size, int rank) {
  return rows / size + (rank < rows % size ? 1 : 0);
}

Status invalid(const std::string& message) {
  return Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: " + message);
}

// Where an op's output goes: the caller's buffer, or one the core
// allocates because only negotiation could tell its size.
void* output_buffer(void* caller_output, size_t bytes, OpResult* result) {
  result->bytes = (int64_t)bytes;
  if (caller_output != nullptr) {
    result->data = caller_output;
    return caller_output;
  }
  // 64-byte aligned, so frameworks can adopt the buffer without a copy
  // (TensorFlow takes only buffers aligned for its widest vector loads).
  constexpr size_t kAlign = 64;
  result->data = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + (bytes == 0 ? kAlign : 0));
  result->core_allocated = true;
  return result->data;
}

}  // namespace

Engine::Engine(const Config& config, std::unique_ptr<Backend> backend, HandleTable* handles)
    : config_(config),
      backend_(std::move(backend)),
      handles_(handles),
      cache_(config.cache_capacity),
      coordinator_(backend_->size()),
      stall_inspector_(config) {
  thread_ = start_engine_thread([this] { loop(); });
}

Engine::~Engine() { stop(); }

void Engine::stop() {
  stop_requested_.store(true);
  backend_->wake();
  if (thread_.joinable()) thread_.join();
}

// ---- the calling side ---------------------------------------------------------

Status Engine::enqueue(const unison_op_options& o, int64_t* handle) {
  const int size = backend_->size();
  Entry e;
  Request& r = e.request;
  r.rank = backend_->rank();
  r.op = o.op;
  r.dtype = o.dtype;
  r.reduce_op = o.reduce_op;
  r.prescale = o.prescale_factor == 0.0 ? 1.0 : o.prescale_factor;
  r.postscale = o.postscale_factor == 0.0 ? 1.0 : o.postscale_factor;
  r.root = o.root_rank;
  r.device = o.device;
  e.input = o.input;
  e.output = o.output;

  if (o.op < UNISON_ALLREDUCE || o.op > UNISON_JOIN) return invalid("unknown op " + std::to_string(o.op));
  const bool carries_tensor = o.op != UNISON_BARRIER && o.op != UNISON_JOIN;
  // Built only for an error message: this function runs once per tensor.
  auto what = [&o] {
    return std::string(op_name(o.op)) + (o.name != nullptr && *o.name ? std::string(" '") + o.name + "'" : "");
  };
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
    const bool needs_input = o.op != UNISON_BROADCAST || o.root_rank == r.rank;
    if (bytes > 0 && needs_input && o.input == nullptr) return invalid(what() + ": input pointer is NULL");
    if (bytes > 0 && (o.op == UNISON_ALLREDUCE || o.op == UNISON_BROADCAST) && o.output == nullptr)
      return invalid(what() + ": output pointer is NULL");
    if ((o.op == UNISON_ALLGATHER || o.op == UNISON_ALLTOALL || o.op == UNISON_REDUCESCATTER) && o.ndim == 0)
      return invalid(what() + ": needs a tensor with at least one dimension, got a scalar");
  }
  if (o.op == UNISON_ALLREDUCE || o.op == UNISON_REDUCESCATTER) {
    if (o.reduce_op == UNISON_ADASUM)
      return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + what() + ": Adasum is not implemented yet");
    if (o.reduce_op < UNISON_SUM || o.reduce_op > UNISON_PRODUCT)
      return invalid(what() + ": unknown reduce op " + std::to_string(o.reduce_op));
    if (o.dtype == UNISON_BOOL && (o.reduce_op == UNISON_AVERAGE || r.prescale != 1.0 || r.postscale != 1.0))
      return invalid(what() + ": bool tensors support Sum (any), Max (any), Min (all) and Product (all) without scale factors");
  }
  if (o.op == UNISON_BROADCAST && (o.root_rank < 0 || o.root_rank >= size))
    return invalid(what() + ": root rank " + std::to_string(o.root_rank) + " is outside 0.." + std::to_string(size - 1));
  if (o.op == UNISON_ALLTOALL) {
    const int64_t rows = r.shape[0];
    if (o.splits == nullptr) {
      if (rows % size != 0)
        return invalid(what() + ": first dimension " + std::to_string(rows) + " does not divide evenly among " +
                       std::to_string(size) + " ranks; pass splits");
      r.splits.assign(size, rows / size);
    } else {
      if (o.nsplits != size)
        return invalid(what() + ": got " + std::to_string(o.nsplits) + " splits for " + std::to_string(size) + " ranks");
      r.splits.assign(o.splits, o.splits + o.nsplits);
      int64_t total = 0;
      for (int64_t s : r.splits) {
        if (s < 0) return invalid(what() + ": negative split in " + shape_string(r.splits));
        total += s;
      }
      if (total != rows)
        return invalid(what() + ": splits " + shape_string(r.splits) + " add up to " + std::to_string(total) +
                       " rows, the tensor has " + std::to_string(rows));
    }
  }
  if (o.process_set_id != UNISON_GLOBAL_PROCESS_SET)
    return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + what() + ": only the global process set (0) exists so far");
  if (o.device != UNISON_CPU_DEVICE)
    return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: " + what() + ": device " + std::to_string(o.device) +
                                                     " given, but this build supports CPU memory only");

  std::lock_guard<std::mutex> lock(queue_mutex_);
  if (!terminal_.ok()) return terminal_;
  if (o.name != nullptr && *o.name != '\0') {
    r.name = o.name;
  } else if (o.op == UNISON_JOIN) {
    r.name = "join";
  } else {
    r.name = std::string(op_name(o.op)) + ".noname." + std::to_string(++unnamed_ops_);
  }
  if (in_flight_.count(r.name))
    return invalid(std::string(op_name(o.op)) + " '" + r.name + "': a tensor of this name is already in flight on rank " +
                   std::to_string(r.rank) + "; wait for it, or give the new one another name");
  e.handle = handles_->create();
  *handle = e.handle;
  in_flight_.insert(r.name);
  queue_.push_back(std::move(e));
  backend_->wake();
  return Status::OK();
}

// ---- the engine thread ---------------------------------------------------------

void Engine::loop() {
  while (!stopped_) {
    const uint32_t token = backend_->activity_token();
    if (cycles_done_ < backend_->requested_cycles()) {
      last_cycle_start_ = monotonic_seconds();
      Status s = run_cycle();
      ++cycles_done_;
      if (!s.ok()) fail_everything(s);
      continue;
    }
    if (has_local_work()) {
      if (config_.cycle_time_ms > 0) {
        double wait = last_cycle_start_ + config_.cycle_time_ms * 1e-3 - monotonic_seconds();
        if (wait > 0) backend_->wait_for_activity(token, wait);
        if (cycles_done_ < backend_->requested_cycles()) continue;
      }
      backend_->request_cycles(cycles_done_ + 1);
      continue;
    }
    const double now = monotonic_seconds();
    if (backend_->rank() == 0 && stall_inspector_.due(oldest_waiting_since(), now)) {
      backend_->request_cycles(cycles_done_ + 1);
      continue;
    }
    if (!pending_.empty()) {
      Status s = backend_->check_peers();
      if (!s.ok()) {
        fail_everything(s);
        continue;
      }
    }
    backend_->wait_for_activity(token, kIdleWakeSeconds);
  }
}

bool Engine::has_local_work() {
  if (another_cycle_ || !to_send_.empty() || stop_requested_.load()) return true;
  std::lock_guard<std::mutex> lock(queue_mutex_);
  return !queue_.empty();
}

void Engine::take_new_requests(CycleMessage* message) {
  std::vector<Entry> fresh;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    fresh.swap(queue_);
  }
  for (Entry& e : fresh) {
    const std::string name = e.request.name;
    int position = -1;
    ResponseCache::Lookup found = ResponseCache::Lookup::kMiss;
    if (e.request.op == UNISON_JOIN) joined_ = true;
    if (!anyone_joined_ && cache_.capacity() > 0 && e.request.op != UNISON_JOIN && e.request.op != UNISON_BARRIER)
      found = cache_.lookup(e.request, backend_->size(), &position);
    if (found == ResponseCache::Lookup::kHit) {
      e.cache_position = position;
    } else {
      if (found == ResponseCache::Lookup::kStale) set_bit(&message->invalid_bits, position);
      to_send_.push_back(name);
    }
    pending_.emplace(name, std::move(e));
  }
  // Full requests, as many as fit in one message; the rest wait a cycle.
  size_t budget = backend_->max_message_bytes() - 64 - (size_t)cache_.capacity() / 4;
  size_t used = 0;
  size_t taken = 0;
  for (; taken < to_send_.size(); ++taken) {
    const Request& r = pending_.at(to_send_[taken]).request;
    size_t bytes = encoded_size(r);
    if (taken > 0 && used + bytes > budget) break;
    used += bytes;
    message->requests.push_back(r);
  }
  to_send_.erase(to_send_.begin(), to_send_.begin() + taken);
  if (!to_send_.empty()) message->flags |= CycleMessage::kMoreQueued;
  for (const auto& [name, e] : pending_)
    if (e.cache_position >= 0) set_bit(&message->ready_bits, e.cache_position);
  if (joined_) message->flags |= CycleMessage::kJoined;
  if (stop_requested_.load()) message->flags |= CycleMessage::kShutdown;
}

Status Engine::run_cycle() {
  const int size = backend_->size();
  const int rank = backend_->rank();
  CycleMessage mine;
  take_new_requests(&mine);
  const double now = monotonic_seconds();
  // Rank 0 owes the others a response list when its coordinator holds
  // responses back or the stall inspector has something to fail.
  bool coordinator_news = false;
  bool stall_check = false;
  if (rank == 0) {
    stall_check = stall_inspector_.due(oldest_waiting_since(), now);
    coordinator_news = another_cycle_ || stall_check;
  }
  if (coordinator_news) mine.flags |= CycleMessage::kMoreQueued;

  std::vector<std::string> raw;
  Status s = backend_->exchange(encode(mine), &raw);
  if (!s.ok()) return s;
  std::vector<CycleMessage> all(size);
  for (int r = 0; r < size; ++r) {
    s = decode(raw[r], &all[r]);
    if (!s.ok()) return s;
  }

  for (int r = 0; r < size; ++r) {
    if (all[r].flags & CycleMessage::kShutdown) {
      Status down = Status::Error(UNISON_ERR_SHUT_DOWN, "unison: rank " + std::to_string(r) +
                                                            " has shut down; no more collectives can run in this job");
      fail_everything(down);
      stopped_ = true;
      return Status::OK();
    }
  }

  // Combine the cache bits: a position runs when every rank has it ready
  // (a joined rank counts as ready for everything) and none invalidated it.
  bool any_requests = false, any_joined = false, more = false;
  const int words = (cache_.capacity() + 63) / 64;
  std::vector<uint64_t> agreed(words, ~0ull), invalid(words, 0), anywhere(words, 0);
  for (const CycleMessage& m : all) {
    any_requests |= !m.requests.empty();
    any_joined |= (m.flags & CycleMessage::kJoined) != 0;
    more |= (m.flags & CycleMessage::kMoreQueued) != 0;
    for (int w = 0; w < words; ++w) {
      uint64_t ready = w < (int)m.ready_bits.size() ? m.ready_bits[w] : 0;
      if (!(m.flags & CycleMessage::kJoined)) agreed[w] &= ready;
      anywhere[w] |= ready;
      if (w < (int)m.invalid_bits.size()) invalid[w] |= m.invalid_bits[w];
    }
  }
  anyone_joined_ = any_joined;
  bool resend = false;
  for (auto& [name, e] : pending_) {
    if (e.cache_position < 0) continue;
    // While some rank waits in join, tensors go through the coordinator,
    // which knows who joined; a stale position is renegotiated in full.
    if (any_joined || test_bit(invalid, e.cache_position)) {
      e.cache_position = -1;
      to_send_.push_back(name);
      resend = true;
    }
  }
  // What runs this cycle, in the order every rank executes it. Pointers:
  // the cache is not changed again until everything here has run.
  std::vector<const Response*> responses;
  for_each_set_bit(invalid, [&](int p) {
    cache_.erase(p);
    partial_bits_.erase(p);
  });
  if (!any_joined) {
    for_each_set_bit(anywhere, [&](int p) {
      if (p >= cache_.capacity() || test_bit(invalid, p)) return;
      if (test_bit(agreed, p)) {
        responses.push_back(&cache_.response(p));
        cache_.touch(p);
        partial_bits_.erase(p);
      } else if (rank == 0) {
        // Remember who has it ready, for the stall inspector's report.
        auto [it, fresh] = partial_bits_.try_emplace(p);
        if (fresh) it->second = Waiting{cache_.response(p).tensors[0].name, cache_.response(p).op, {}, now};
        it->second.submitted.assign(size, false);
        for (int r = 0; r < size; ++r) it->second.submitted[r] = test_bit(all[r].ready_bits, p);
      }
    });
  }

  // Full negotiation, only when some rank needed it.
  ResponseList decided;
  if (any_requests || more) {
    std::string encoded;
    if (rank == 0) {
      for (const CycleMessage& m : all)
        for (const Request& r : m.requests) coordinator_.add(r, now);
      if (stall_check) {
        for (const auto& [name, message] : stall_inspector_.inspect(stalled_candidates(), now)) {
          coordinator_.fail(name, UNISON_ERR_STALLED, message);
          for (auto it = partial_bits_.begin(); it != partial_bits_.end();) {
            if (it->second.name == name) {
              decided.responses.push_back(error_response(name, UNISON_ERR_STALLED, message));
              it = partial_bits_.erase(it);
            } else {
              ++it;
            }
          }
        }
      }
      bool held_back = false;
      std::vector<Response> ready = coordinator_.take_ready(backend_->max_message_bytes() / 2, &held_back);
      for (Response& r : ready) decided.responses.push_back(std::move(r));
      decided.more_ready = held_back;
      encoded = encode(decided);
    }
    s = backend_->broadcast_message(&encoded, 0);
    if (!s.ok()) return s;
    if (rank != 0) {
      s = decode(encoded, &decided);
      if (!s.ok()) return s;
    }
  }
  for (const Response& r : decided.responses) responses.push_back(&r);

  for (const auto& group : fuse(responses)) {
    execute(group);
    publish_completions();
  }

  // Every rank remembers the same new responses in the same order, so the
  // caches stay identical. A put may evict a position some rank still waits
  // on; that rank then sends its request in full.
  for (const Response& r : decided.responses)
    if (r.cacheable && !r.is_error() && r.op != UNISON_BARRIER && r.op != UNISON_JOIN) cache_.put(r);
  for (auto& [name, e] : pending_) {
    if (e.cache_position < 0) continue;
    if (!cache_.occupied(e.cache_position) || cache_.response(e.cache_position).tensors[0].name != name) {
      e.cache_position = -1;
      to_send_.push_back(name);
      resend = true;
    }
  }
  another_cycle_ = more || decided.more_ready || resend;
  return Status::OK();
}

double Engine::oldest_waiting_since() const {
  double oldest = coordinator_.oldest_since();
  for (const auto& [position, partial] : partial_bits_) oldest = std::min(oldest, partial.since);
  return oldest;
}

std::vector<Waiting> Engine::stalled_candidates() {
  std::vector<Waiting> waiting = coordinator_.waiting();
  for (const auto& [position, partial] : partial_bits_) waiting.push_back(partial);
  return waiting;
}

// ---- fusion and execution -------------------------------------------------------

std::vector<std::vector<const Response*>> Engine::fuse(const std::vector<const Response*>& responses) const {
  // Compatible responses share a group until it would pass the threshold.
  // The grouping depends only on the list, which every rank has the same.
  using Key = std::tuple<int, int, int, double, double, int>;
  std::vector<std::vector<const Response*>> groups;
  std::map<Key, std::pair<size_t, size_t>> open;  // key -> (group index, bytes)
  const int size = backend_->size();
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
    if (it != open.end() && it->second.second + bytes <= config_.fusion_threshold_bytes) {
      groups[it->second.first].push_back(&r);
      it->second.second += bytes;
    } else {
      open[key] = {groups.size(), bytes};
      groups.push_back({&r});
    }
  }
  return groups;
}

void Engine::complete(const std::string& name, const Status& status, OpResult result) {
  auto it = pending_.find(name);
  if (it == pending_.end()) {
    if (result.core_allocated) std::free(result.data);
    return;
  }
  finished_.push_back(Completion{it->second.handle, status, std::move(result)});
  finished_names_.push_back(name);
  pending_.erase(it);
}

void Engine::publish_completions() {
  if (finished_.empty()) return;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    for (const std::string& name : finished_names_) in_flight_.erase(name);
  }
  finished_names_.clear();
  handles_->complete(&finished_);
}

void Engine::execute(const std::vector<const Response*>& group) {
  const Response& head = *group[0];
  const int size = backend_->size();
  const int rank = backend_->rank();
  if (head.is_error()) {
    complete(head.tensors[0].name, Status::Error(head.error_code, head.error));
    return;
  }
  auto local = [&](const std::string& name) -> Entry* {
    auto it = pending_.find(name);
    return it == pending_.end() ? nullptr : &it->second;
  };
  // A rank that has joined has no tensors of its own: it contributes zeros
  // (or nothing) from scratch memory and drops what it receives.
  std::vector<std::vector<char>> scratch;
  auto zeros = [&](size_t bytes) -> char* {
    scratch.emplace_back(bytes > 0 ? bytes : 1, 0);
    return scratch.back().data();
  };
  std::vector<OpResult> results(group.size());
  Status status;

  switch (head.op) {
    case UNISON_ALLREDUCE: {
      AllreduceOptions o;
      o.reduce = ReduceSpec{head.dtype, head.reduce_op, head.prescale, head.postscale, size};
      for (size_t i = 0; i < group.size(); ++i) {
        const TensorPlan& t = group[i]->tensors[0];
        const size_t bytes = (size_t)element_count(t.shape) * dtype_size(head.dtype);
        Entry* e = local(t.name);
        if (e != nullptr) {
          results[i].data = e->output;
          results[i].bytes = (int64_t)bytes;
          results[i].shape = t.shape;
          o.segments.push_back({e->input, e->output, bytes});
        } else {
          char* z = zeros(bytes);
          o.segments.push_back({z, z, bytes});
        }
      }
      status = backend_->allreduce(o);
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
        part.output = output_buffer(e != nullptr ? e->output : nullptr, total, &results[i]);
        results[i].shape = t.shape;
        results[i].shape[0] = rows;
        o.tensors.push_back(part);
      }
      status = backend_->allgather(o);
      break;
    }
    case UNISON_BROADCAST: {
      const TensorPlan& t = head.tensors[0];
      Entry* e = local(t.name);
      const size_t bytes = (size_t)element_count(t.shape) * dtype_size(head.dtype);
      void* buffer = e != nullptr ? output_buffer(e->output, bytes, &results[0]) : zeros(bytes);
      if (e != nullptr && rank == head.root && bytes > 0 && buffer != e->input) std::memcpy(buffer, e->input, bytes);
      results[0].shape = t.shape;
      status = backend_->broadcast(BroadcastOptions{buffer, bytes, head.root});
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
      o.output = output_buffer(e != nullptr ? e->output : nullptr, (size_t)rows_in * row, &results[0]);
      results[0].shape = t.shape;
      results[0].shape[0] = rows_in;
      status = backend_->alltoall(o);
      break;
    }
    case UNISON_REDUCESCATTER: {
      ReducescatterOptions o;
      o.reduce = ReduceSpec{head.dtype, head.reduce_op, head.prescale, head.postscale, size};
      for (size_t i = 0; i < group.size(); ++i) {
        const TensorPlan& t = group[i]->tensors[0];
        Entry* e = local(t.name);
        const size_t row = row_bytes(t.shape, head.dtype);
        ReducescatterOptions::Tensor part;
        for (int p = 0; p < size; ++p) part.bytes_per_rank.push_back((size_t)scatter_rows(t.shape[0], size, p) * row);
        const size_t total = (size_t)element_count(t.shape) * dtype_size(head.dtype);
        part.input = e != nullptr ? e->input : zeros(total);
        part.output = output_buffer(e != nullptr ? e->output : nullptr, part.bytes_per_rank[rank], &results[i]);
        results[i].shape = t.shape;
        results[i].shape[0] = scatter_rows(t.shape[0], size, rank);
        o.tensors.push_back(part);
      }
      status = backend_->reducescatter(o);
      break;
    }
    case UNISON_BARRIER:
      break;  // every rank reached it: negotiation was the barrier
    case UNISON_JOIN:
      joined_ = false;
      results[0].join_rank = head.last_joined_rank;
      break;
  }

  for (size_t i = 0; i < group.size(); ++i) {
    const std::string& name = group[i]->tensors[0].name;
    if (local(name) == nullptr && results[i].core_allocated) {
      std::free(results[i].data);
      continue;
    }
    complete(name, status, std::move(results[i]));
  }
  if (!status.ok()) fail_everything(status);
}

void Engine::fail_everything(const Status& status) {
  publish_completions();
  std::vector<Entry> queued;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (terminal_.ok()) terminal_ = status;
    queued.swap(queue_);
    in_flight_.clear();
  }
  for (Entry& e : queued) handles_->complete(e.handle, status);
  for (auto& [name, e] : pending_) handles_->complete(e.handle, status);
  pending_.clear();
  to_send_.clear();
  if (status.code == UNISON_ERR_RANK_FAILED) {
    std::fprintf(stderr, "%s\n", status.message.c_str());
    std::fflush(stderr);
  }
  stopped_ = true;
}

}  // namespace unison
