#include "engine.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "caller_activity.h"
#include "dtype.h"
#include "log.h"

namespace unison {

Engine::Engine(const Config& config, std::unique_ptr<Backend> backend, HandleTable* handles)
    : config_(config), backend_(std::move(backend)), handles_(handles) {
  std::vector<int> everyone(backend_->size());
  for (int r = 0; r < backend_->size(); ++r) everyone[r] = r;
  set_ranks_[0] = everyone;
  auto global = std::make_unique<ProcessSetState>(0, everyone, backend_->rank(), backend_.get(), nullptr, config_);
  global_ = global.get();
  sets_.emplace(0, std::move(global));
  tuned_.fusion_threshold_bytes = config_.fusion_threshold_bytes;
  tuned_.cycle_time_ms = config_.cycle_time_ms;
  tuned_.cache = config_.cache_capacity > 0;
  const bool switches = backend_->set_hierarchical(true);
  tuned_.hierarchical = switches;
  if (config_.autotune && backend_->rank() == 0)
    tuner_ = std::make_unique<Autotuner>(config_, tuned_, switches);
  if (!config_.timeline_path.empty()) {
    // Each later round of an elastic job has a file of its own (t.round2.json),
    // since its rank 0 may be another process than round 0's.
    std::string path = config_.timeline_path;
    if (config_.elastic_round > 0) {
      const size_t dot = path.rfind('.');
      const std::string suffix = ".round" + std::to_string(config_.elastic_round);
      path = dot == std::string::npos || path.find('/', dot) != std::string::npos
                 ? path + suffix
                 : path.substr(0, dot) + suffix + path.substr(dot);
    }
    Status s = start_timeline(path, config_.timeline_mark_cycles);
    if (!s.ok()) log_message(LogLevel::warning, "%s (UNISON_TIMELINE); running without a timeline\n", s.message.c_str());
  }
  overlap_ = decide_overlap(config_, *backend_);
  start_thread();
}

TunedSettings Engine::settings() const {
  std::lock_guard<std::mutex> lock(tuned_mutex_);
  return tuned_;
}

void Engine::apply_tuning(const CycleMessage& m) {
  std::lock_guard<std::mutex> lock(tuned_mutex_);
  if ((m.tuned_cache != 0) != tuned_.cache) cache_switched_ = true;
  tuned_.fusion_threshold_bytes = m.tuned_fusion_threshold;
  tuned_.cycle_time_ms = m.tuned_cycle_time_ms;
  tuned_.cache = m.tuned_cache != 0;
  tuned_.hierarchical = m.tuned_hierarchical != 0;
  tuned_.settled = m.tuned_settled != 0;
  backend_->set_hierarchical(tuned_.hierarchical);
}

Status Engine::start_timeline(const std::string& path, bool mark_cycles) {
  if (backend_->rank() != 0) return Status::OK();
  return timeline_.start(path, mark_cycles);
}

// ---- the engine thread (driving it: engine_driver.cc) ---------------------------

bool Engine::has_local_work(double queue_age, double* claim_in) {
  if (stop_requested_.load()) return true;
  for (const auto& [id, set] : sets_)
    if (set->another_cycle || !set->to_send.empty()) return true;
  if (data_became_ready()) return true;
  std::lock_guard<std::mutex> lock(queue_mutex_);
  if (queue_.empty()) return false;
  if (queue_age <= 0 || claimed_by_poll_.load()) return true;
  // Unclaimed ops are taken once their producer has gone quiet for
  // queue_age (backward enqueues a gradient every few milliseconds, and the
  // step's wait claims them all right after), or at the latest once the
  // oldest has waited kUnclaimedAtMostFactor times that.
  const double wait = std::min(last_enqueued_at_ + queue_age, queued_since_ + kUnclaimedAtMostFactor * queue_age) -
                      monotonic_seconds();
  if (claim_in != nullptr) *claim_in = wait;
  return wait <= 0;
}

bool Engine::stall_check_due(const ProcessSetState& set, double now) const {
  return set.rank == 0 && set.stall_inspector.due(oldest_waiting_since(set), now);
}

bool Engine::input_ready(const Entry& e) {
  return e.input_ready == nullptr || __atomic_load_n(e.input_ready, __ATOMIC_ACQUIRE) != 0;
}

bool Engine::data_became_ready() const {
  for (const Entry& e : waiting_for_data_)
    if (input_ready(e)) return true;
  return false;
}

void Engine::warn_of_late_data(double now) {
  if (!config_.stall_check_enabled) return;
  for (Entry& e : waiting_for_data_) {
    const double waited = now - e.data_wait_since;
    if (e.data_wait_reported || waited < config_.stall_warning_seconds) continue;
    e.data_wait_reported = true;
    log_message(LogLevel::warning,
                "unison: warning: rank %d: %s '%s' has waited %d s for its input: its producer has not set "
                "input_ready, and the other ranks wait for this rank in negotiation\n",
                backend_->rank(), op_name(e.request.op), e.request.name.c_str(), (int)waited);
  }
}

void Engine::take_new_requests() {
  // Ops whose data has come go first: they were enqueued before the queue's.
  std::vector<Entry>& fresh = taken_;  // empty: cleared at the end of the last call
  if (!waiting_for_data_.empty()) {
    std::vector<Entry> still_waiting;
    for (Entry& e : waiting_for_data_) (input_ready(e) ? fresh : still_waiting).push_back(std::move(e));
    waiting_for_data_.swap(still_waiting);
  }
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    claimed_by_poll_.store(false);
    if (fresh.empty()) {
      fresh.swap(queue_);  // queue_ gets last cycle's buffer, at its capacity
    } else {
      for (Entry& e : queue_) fresh.push_back(std::move(e));
      queue_.clear();
    }
  }
  for (Entry& e : fresh) {
    auto found_set = sets_.find(e.process_set);
    if (found_set == sets_.end()) {  // removed after this op was enqueued
      {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        unmark_in_flight(e.process_set, e.request.name);
      }
      handles_->complete(e.handle, Status::Error(UNISON_ERR_SHUT_DOWN, "unison: " + std::string(op_name(e.request.op)) +
                                                                          " '" + e.request.name + "': process set " +
                                                                          std::to_string(e.process_set) + " was removed"));
      continue;
    }
    const std::string& name = e.request.name;  // e's own: used only before e is moved
    const bool waited_for_data = e.data_wait_since >= 0;
    if (!waited_for_data && !input_ready(e)) {
      e.data_wait_since = monotonic_seconds();
      if (timeline_.active()) {
        timeline_.end(name, "QUEUED");
        timeline_.begin(name, "WAIT_FOR_DATA");
      }
      waiting_for_data_.push_back(std::move(e));
      continue;
    }
    ProcessSetState& set = *found_set->second;
    set.fresh = true;
    if (timeline_.active()) {
      timeline_.end(name, waited_for_data ? "WAIT_FOR_DATA" : "QUEUED");
      timeline_.begin(name, "NEGOTIATE");
    }
    int position = -1;
    ResponseCache::Lookup found = ResponseCache::Lookup::kMiss;
    if (e.request.op == UNISON_JOIN) joined_ = true;
    // Whether a tensor goes by cache bit or in full must not depend on when
    // this rank took it: ranks take it at different cycles, and a full
    // request never pairs with a peer's bit. So the choice depends only on
    // the cache, identical everywhere. (Skipping the lookup while someone
    // had joined sent a tensor in full on a rank that took it the cycle
    // after a join ended, and by bit on one that took it a cycle later:
    // both then waited for good.) While a rank waits in join, negotiate()
    // turns every bit back into a full request, for the coordinator.
    if (tuned_.cache && set.cache.capacity() > 0 && e.request.op <= UNISON_REDUCESCATTER)
      found = set.cache.lookup(e.request, set.size(), &position);
    if (found == ResponseCache::Lookup::kHit) {
      e.cache_position = position;
    } else {
      if (found == ResponseCache::Lookup::kStale) set_bit(&set.invalid_bits, position);
      set.to_send.push_back(name);
    }
    add_pending(set, std::move(e));
  }
  fresh.clear();
  // A burst of tens of thousands of ops should not pin its memory for good.
  if (fresh.capacity() > kKeptQueueCapacity) std::vector<Entry>().swap(fresh);
}

void Engine::add_pending(ProcessSetState& set, Entry&& e) {
  PendingTable::node_type node = spare_pending_.take();
  if (node.empty()) {
    // try_emplace copies the key before it moves the entry, so the key may
    // be the entry's own name: one copy of it instead of two.
    set.pending.try_emplace(e.request.name, std::move(e));
    return;
  }
  node.key() = e.request.name;  // into the kept key's memory
  node.mapped() = std::move(e);
  auto placed = set.pending.insert(std::move(node));
  if (!placed.inserted) {  // never: in_flight_ refused the name at enqueue
    placed.node.mapped() = Entry();
    spare_pending_.keep(std::move(placed.node));
  }
}

void Engine::build_message(ProcessSetState& set, CycleMessage* message, double now) {
  // Full requests, as many as fit in one message; the rest wait a cycle.
  // What the cache's bits and the sets' ids leave; init made sure that is
  // room for requests with the global set, but every added set takes some.
  const size_t room = set.backend->max_message_bytes(), reserved = 64 + (size_t)set.cache.capacity() / 4 + 4 * sets_.size();
  const size_t budget = room > reserved ? room - reserved : 0;
  size_t used = 0;
  size_t taken = 0;
  for (; taken < set.to_send.size(); ++taken) {
    const Request& r = set.pending.at(set.to_send[taken]).request;
    size_t bytes = encoded_size(r);
    if (taken > 0 && used + bytes > budget) break;
    used += bytes;
    message->requests.push_back(r);
  }
  set.to_send.erase(set.to_send.begin(), set.to_send.begin() + taken);
  if (!set.to_send.empty()) message->flags |= CycleMessage::kMoreQueued;
  for (const auto& [name, e] : set.pending)
    if (e.cache_position >= 0) set_bit(&message->ready_bits, e.cache_position);
  message->invalid_bits.swap(set.invalid_bits);  // the message's were empty
  // The set's rank 0 owes the others a response list when its coordinator
  // holds responses back or the stall inspector has something to fail.
  set.stall_check = stall_check_due(set, now);
  if (set.rank == 0 && (set.responses_held_back || set.stall_check)) message->flags |= CycleMessage::kMoreQueued;
  // An op waiting for its data here will still be submitted: not blocked.
  if (config_.stall_check_enabled && waiting_for_data_.empty() &&
      caller_activity::blocked_for(config_.stall_warning_seconds, now))
    message->flags |= CycleMessage::kBlocked;
  set.fresh = false;
  if (&set != global_) return;
  TunedSettings next;
  if (tuner_ != nullptr && tuner_->next(&next)) {
    message->flags |= CycleMessage::kTuning;
    message->tuned_fusion_threshold = next.fusion_threshold_bytes;
    message->tuned_cycle_time_ms = next.cycle_time_ms;
    message->tuned_cache = next.cache ? 1 : 0;
    message->tuned_hierarchical = next.hierarchical ? 1 : 0;
    message->tuned_settled = next.settled ? 1 : 0;
  }
  if (joined_) message->flags |= CycleMessage::kJoined;
  if (stop_requested_.load()) message->flags |= CycleMessage::kShutdown;
  for (const auto& [id, other] : sets_)
    if (id != 0 && (other->fresh || other->another_cycle || !other->to_send.empty() || stall_check_due(*other, now)))
      message->busy_sets.push_back(id);
}

Status Engine::exchange(ProcessSetState& set, const CycleMessage& mine, std::vector<CycleMessage>* all) {
  std::vector<std::string> raw;
  Status s = set.backend->exchange(encode(mine), &raw);
  if (!s.ok()) return s;
  all->assign(set.size(), CycleMessage());
  for (int r = 0; r < set.size(); ++r) {
    s = decode(raw[r], &(*all)[r]);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

// One cycle: the global set first, then every other set that some rank
// has work for, in id order. Every member of a set learns from the global
// exchange that its set is busy, so all of them run its cycle, and ranks
// in two sets meet in each in the same order: sets never deadlock each
// other, and a set's cycle involves its members only.
Status Engine::run_cycle() {
  take_new_requests();
  const double now = monotonic_seconds();
  CycleMessage mine;
  build_message(*global_, &mine, now);
  std::vector<CycleMessage> all;
  Status s = exchange(*global_, mine, &all);
  if (!s.ok()) return s;

  // Rank 0's autotuner switches every rank here, at the same cycle.
  if (all[0].flags & CycleMessage::kTuning) apply_tuning(all[0]);
  std::set<int> busy;
  // Every rank of the job, not just a set's members: a set's op may wait for
  // a member that is blocked on a global op some busy rank will still join.
  everyone_blocked_ = std::all_of(all.begin(), all.end(), [](const CycleMessage& m) {
    return (m.flags & CycleMessage::kBlocked) != 0;
  });
  for (int r = 0; r < (int)all.size(); ++r) {
    if (all[r].flags & CycleMessage::kShutdown) {
      Status down = Status::Error(UNISON_ERR_SHUT_DOWN, "unison: rank " + std::to_string(r) +
                                                            " has shut down; no more collectives can run in this job");
      fail_everything(down);
      stopped_ = true;
      return Status::OK();
    }
    busy.insert(all[r].busy_sets.begin(), all[r].busy_sets.end());
  }
  s = negotiate(*global_, all, now);
  if (!s.ok() || stopped_) return s;
  for (int id : busy) {
    auto it = sets_.find(id);
    if (it == sets_.end()) continue;  // not a member, or removed this cycle
    ProcessSetState& set = *it->second;
    CycleMessage set_mine;
    build_message(set, &set_mine, now);
    std::vector<CycleMessage> set_all;
    s = exchange(set, set_mine, &set_all);
    if (s.ok()) s = negotiate(set, set_all, now);
    if (!s.ok() || stopped_) return s;
  }
  if (cache_switched_) switch_cache();
  return Status::OK();
}

// The autotuner turned the response cache on or off this cycle, on every
// rank. A tensor must be negotiated the same way on every rank (all by
// cache bit, or all in full), but ranks took their pending tensors at
// different cycles, some before the switch and some after. So, at the end
// of the switching cycle, every rank sends what waits as a bit in full, and
// a cache turned back on starts empty: nothing can hit on one rank while
// another sent it in full.
void Engine::switch_cache() {
  cache_switched_ = false;
  for (auto& [id, set] : sets_) {
    for (auto& [name, e] : set->pending) {
      if (e.cache_position < 0) continue;
      e.cache_position = -1;
      set->to_send.push_back(name);
      set->another_cycle = true;
    }
    set->partial_bits.clear();
    if (tuned_.cache)
      for (int p = 0; p < set->cache.capacity(); ++p)
        if (set->cache.occupied(p)) set->cache.erase(p);
  }
}

// Decides what runs in `set` this cycle from everyone's messages, runs it,
// and remembers the new responses.
Status Engine::negotiate(ProcessSetState& set, const std::vector<CycleMessage>& all, double now) {
  const int size = set.size();
  const int rank = set.rank;
  ResponseCache& cache = set.cache;

  // Combine the cache bits: a position runs when every rank has it ready
  // (a joined rank counts as ready for everything) and none invalidated it.
  bool any_requests = false, any_joined = false, more = false;
  const int words = (cache.capacity() + 63) / 64;
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
  if (timeline_.active()) note_arrivals(set, all, anywhere);
  bool resend = false;
  for (auto& [name, e] : set.pending) {
    if (e.cache_position < 0) continue;
    // While some rank waits in join, tensors go through the coordinator,
    // which knows who joined; a stale position is renegotiated in full.
    if (any_joined || test_bit(invalid, e.cache_position)) {
      e.cache_position = -1;
      set.to_send.push_back(name);
      resend = true;
    }
  }
  // What runs this cycle, in the order every rank executes it. Pointers:
  // the cache is not changed again until everything here has run.
  std::vector<const Response*> responses;
  for_each_set_bit(invalid, [&](int p) {
    cache.erase(p);
    set.partial_bits.erase(p);
  });
  if (!any_joined) {
    for_each_set_bit(anywhere, [&](int p) {
      if (p >= cache.capacity() || test_bit(invalid, p)) return;
      if (test_bit(agreed, p)) {
        responses.push_back(&cache.response(p));
        cache.touch(p);
        set.partial_bits.erase(p);
      } else if (rank == 0) {
        // Remember who has it ready, for the stall inspector's report.
        auto [it, fresh] = set.partial_bits.try_emplace(p);
        if (fresh) it->second = Waiting{cache.response(p).tensors[0].name, cache.response(p).op, {}, now};
        it->second.submitted.assign(size, false);
        for (int r = 0; r < size; ++r) it->second.submitted[r] = test_bit(all[r].ready_bits, p);
      }
    });
  }

  // Full negotiation, only when some rank needed it.
  ResponseList decided;
  set.responses_held_back = false;
  if (any_requests || more) {
    std::string encoded;
    if (rank == 0) {
      for (size_t sender = 0; sender < all.size(); ++sender)
        for (Request r : all[sender].requests) {
          // Who sent a request is its message's place, whatever it says;
          // and what the sender's own enqueue checks would have refused
          // can only be a corrupt message, which no rank can act on.
          r.rank = (int)sender;
          if (Status s = well_formed(r, size); !s.ok())
            return Status::Error(UNISON_ERR_INTERNAL, "unison: rank " + std::to_string(sender) +
                                                          " sent a malformed request: " + s.message);
          set.coordinator.add(r, now);
        }
      if (set.stall_check) {
        for (const auto& [name, code, message] :
             set.stall_inspector.inspect(stalled_candidates(set), now, everyone_blocked_)) {
          set.coordinator.fail(name, code, message);
          for (auto it = set.partial_bits.begin(); it != set.partial_bits.end();) {
            if (it->second.name == name) {
              decided.responses.push_back(error_response(name, code, message));
              it = set.partial_bits.erase(it);
            } else {
              ++it;
            }
          }
        }
      }
      bool held_back = false;
      std::vector<Response> ready = set.coordinator.take_ready(set.backend->max_message_bytes() / 2, &held_back);
      for (Response& r : ready) decided.responses.push_back(std::move(r));
      decided.more_ready = held_back;
      set.responses_held_back = held_back;
      encoded = encode(decided);
    }
    Status s = set.backend->broadcast_message(&encoded, 0);
    if (!s.ok()) return s;
    if (rank != 0) {
      s = decode(encoded, &decided);
      if (!s.ok()) return s;
    }
  }
  for (const Response& r : decided.responses) responses.push_back(&r);

  for (const auto& group : fuse(set, responses)) {
    execute(set, group);
    publish_completions();
    if (stopped_) return Status::OK();  // a collective failed: everything is failed already
  }

  // Every rank remembers the same new responses in the same order, so the
  // caches stay identical. A put may evict a position some rank still waits
  // on; that rank then sends its request in full.
  for (const Response& r : decided.responses)
    if (tuned_.cache && r.cacheable && !r.is_error() && r.op <= UNISON_REDUCESCATTER) cache.put(r);
  for (auto& [name, e] : set.pending) {
    if (e.cache_position < 0) continue;
    if (!cache.occupied(e.cache_position) || cache.response(e.cache_position).tensors[0].name != name) {
      e.cache_position = -1;
      set.to_send.push_back(name);
      resend = true;
    }
  }
  set.another_cycle = more || decided.more_ready || resend;
  return Status::OK();
}

// For the timeline: which rank said which tensor was ready in which cycle,
// by full request or by cache bit, so that NEGOTIATE can name the ranks it
// waited for.
void Engine::note_arrivals(const ProcessSetState& set, const std::vector<CycleMessage>& all,
                           const std::vector<uint64_t>& anywhere) {
  for (int r = 0; r < (int)all.size(); ++r)
    for (const Request& request : all[r].requests) timeline_.arrived(request.name, set.ranks[r], cycles_done_);
  for_each_set_bit(anywhere, [&](int p) {
    if (p >= set.cache.capacity() || !set.cache.occupied(p)) return;
    for (int r = 0; r < (int)all.size(); ++r)
      if (test_bit(all[r].ready_bits, p))
        timeline_.arrived(set.cache.response(p).tensors[0].name, set.ranks[r], cycles_done_);
  });
}

double Engine::oldest_waiting_since(const ProcessSetState& set) const {
  double oldest = set.coordinator.oldest_since();
  for (const auto& [position, partial] : set.partial_bits) oldest = std::min(oldest, partial.since);
  return oldest;
}

std::vector<Waiting> Engine::stalled_candidates(const ProcessSetState& set) {
  std::vector<Waiting> waiting = set.coordinator.waiting();
  for (const auto& [position, partial] : set.partial_bits) waiting.push_back(partial);
  return waiting;
}

// ---- process sets ---------------------------------------------------------------

// Runs on every rank at the same point of the same cycle, so the id and the
// split agree everywhere.
Status Engine::add_process_set(const std::vector<int>& ranks, OpResult* result) {
  const int id = next_set_id_++;
  std::unique_ptr<Backend> split;
  Status s = backend_->split(ranks, id, &split);
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    set_ranks_[id] = ranks;
  }
  if (split != nullptr) {
    const int me = (int)(std::find(ranks.begin(), ranks.end(), backend_->rank()) - ranks.begin());
    Backend* backend = split.get();
    sets_.emplace(id, std::make_unique<ProcessSetState>(id, ranks, me, backend, std::move(split), config_));
  }
  result->process_set_id = id;
  return Status::OK();
}

void Engine::remove_process_set(int id) {
  auto it = sets_.find(id);
  if (it != sets_.end()) {
    const Status removed = Status::Error(UNISON_ERR_SHUT_DOWN, "unison: process set " + std::to_string(id) +
                                                                  " was removed while this op waited in it");
    for (auto& [name, e] : it->second->pending) handles_->complete(e.handle, removed);
    sets_.erase(it);
  }
  for (auto e = waiting_for_data_.begin(); e != waiting_for_data_.end();) {
    if (e->process_set != id) {
      ++e;
      continue;
    }
    handles_->complete(e->handle, Status::Error(UNISON_ERR_SHUT_DOWN, "unison: process set " + std::to_string(id) +
                                                                         " was removed while this op waited for its data"));
    e = waiting_for_data_.erase(e);
  }
  std::lock_guard<std::mutex> lock(queue_mutex_);
  set_ranks_.erase(id);
  in_flight_.erase(id);
  unnamed_ops_.erase(id);
}

void Engine::complete(ProcessSetState& set, const std::string& name, const Status& status, OpResult result) {
  auto it = set.pending.find(name);
  if (it == set.pending.end()) {
    if (result.core_allocated) free_result_memory(result.data);
    return;
  }
  PendingTable::node_type node = set.pending.extract(it);
  Entry& e = node.mapped();
  finished_.push_back(Completion{e.handle, status, std::move(result)});
  // The entry's own copy of the name serves publish_completions (`name`
  // may be that copy: it is not read again).
  finished_names_.emplace_back(set.id, std::move(e.request.name));
  e = Entry();  // its memory, and a GPU op's event, go now, not at the node's reuse
  spare_pending_.keep(std::move(node));
}

void Engine::publish_completions() {
  if (finished_.empty()) return;
  caller_activity::note_completion(monotonic_seconds());
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    for (const auto& [id, name] : finished_names_) unmark_in_flight(id, name);
  }
  finished_names_.clear();
  handles_->complete(&finished_);
}

void Engine::fail_everything(const Status& status) {
  publish_completions();
  std::vector<Entry> queued;
  bool first;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    first = terminal_.ok();
    if (first) terminal_ = status;
    queued.swap(queue_);
    for (auto& [thread, group] : open_groups_)
      for (Entry& e : group.held) queued.push_back(std::move(e));
    open_groups_.clear();
    in_flight_.clear();
  }
  // The peers hear why before any caller does: a caller's error can end
  // the process at once.
  if (first) backend_->stopped_on(status);
  for (Entry& e : queued) handles_->complete(e.handle, status);
  for (Entry& e : waiting_for_data_) handles_->complete(e.handle, status);
  waiting_for_data_.clear();
  for (auto& [id, set] : sets_) {
    for (auto& [name, e] : set->pending) handles_->complete(e.handle, status);
    set->pending.clear();
    set->to_send.clear();
  }
  if (status.code == UNISON_ERR_RANK_FAILED) {
    // Device work that waits on the lost rank would never end, nor would the
    // streams ordered after it. Only then: after any other failure (a peer's
    // shutdown, a refused op) the peers may still be finishing collectives
    // that need this rank's kernels.
    for (auto& [id, set] : sets_)
      for (auto& [device, plane] : set->device_planes) plane->abandon();
    log_message(LogLevel::error, "%s\n", status.message.c_str());
  }
  stopped_ = true;
}

}  // namespace unison
