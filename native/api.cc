// api.cc: the C ABI of unison.h over one process-wide Engine.
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "caller_activity.h"
#include "data_planes.h"
#include "engine.h"
#include "log.h"
#include "start_abort.h"
#include "unison.h"

namespace unison {
namespace {

std::mutex lifecycle_mutex;  // init and shutdown
// Shared so that a caller waiting in unison_wait, which may be driving the
// engine (engine_driver.cc), keeps it alive across a shutdown on another
// thread; init and shutdown swap it atomically for that reader.
std::shared_ptr<Engine> engine;
Config config;
HandleTable handles;
// Counts this process's inits in its current job (UNISON_JOB_ID), so that a
// re-init in the job gets fresh shared memory and names. Counted per job: a
// process that an engine reuses for job after job (a Spark Python worker, a
// Ray actor) may have run more jobs than its new peers, and every rank of a
// job must count alike.
int generation = 0;
std::string generation_job;
thread_local std::string last_error;

int report(const Status& s) {
  if (!s.ok()) last_error = s.message;
  return s.code;
}

// A C caller cannot catch a C++ exception: one that crossed this boundary
// would end the process through std::terminate. Allocation failure (a
// tensor larger than memory, a name of gigabytes) is the one the calls
// below can meet, and it becomes UNISON_ERR_OUT_OF_MEMORY, the process
// staying usable.
template <typename Call>
int guarded(const char* what, Call&& call) noexcept {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    return report(Status::Error(UNISON_ERR_OUT_OF_MEMORY, std::string("unison: out of memory in ") + what));
  } catch (const std::exception& e) {
    return report(Status::Error(UNISON_ERR_INTERNAL, std::string("unison: ") + what + ": " + e.what()));
  }
}

int not_initialized() {
  return report(Status::Error(UNISON_ERR_NOT_INITIALIZED,
                              "unison: not initialized; call init() first (or again after shutdown())"));
}

// A process forked from a rank after init() (a DataLoader's worker, a
// daemon) holds a copy of the engine but none of its threads, and shares the
// rank's shared memory, sockets and MPI state. Were it to run a collective,
// wait on a handle (a waiting caller may drive the engine) or shut down, it
// would act as the rank: take its place in a negotiation, or tell the peers
// that the rank has left, while the rank itself runs on. So in such a child
// every call that touches the job fails at once and shutdown does nothing;
// the queries (rank, size...) still answer.
pid_t forked_from = 0;  // in such a child: the rank's own process

void note_fork_in_child() {
  if (engine == nullptr || forked_from != 0) return;
  forked_from = getppid();
  // Nor may the child's exit destroy its copy of the engine: the engine's
  // destructor, run by exit() with the other statics, would tell the peers
  // that the rank left. One reference that nobody releases keeps it.
  new std::shared_ptr<Engine>(engine);
}

int refuse_in_forked_child() {
  return report(Status::Error(
      UNISON_ERR_UNSUPPORTED,
      "unison: this process (pid " + std::to_string(getpid()) + ") was forked from rank " +
          std::to_string(config.rank) + " (pid " + std::to_string(forked_from) +
          ") after init(); only the rank's own process takes part in its collectives. rank(), size() and "
          "the other queries still answer here"));
}

int query(int* out, int value) {
  if (engine == nullptr) return not_initialized();
  if (out == nullptr) return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: NULL output pointer"));
  *out = value;
  return UNISON_OK;
}

}  // namespace
}  // namespace unison

using namespace unison;

extern "C" {

int unison_init(void) {
  return guarded("unison_init", [&]() -> int {
    if (forked_from != 0) return UNISON_OK;  // the rank's state, copied: the queries answer
    std::lock_guard<std::mutex> lock(lifecycle_mutex);
    if (engine != nullptr) return UNISON_OK;  // as Horovod: a second init is harmless
    static const int fork_watch = pthread_atfork(nullptr, nullptr, note_fork_in_child);
    (void)fork_watch;
    Config c;
    Status read = Config::from_environment(&c);
    if (!read.ok()) return report(read);
    set_log_level(c.log_level);
    if (c.size < 1 || c.rank < 0 || c.rank >= c.size)
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: rank " + std::to_string(c.rank) +
                                                                   " of size " + std::to_string(c.size) +
                                                                   " from the environment is impossible"));
    if (c.job_id != generation_job) {
      generation_job = c.job_id;
      generation = 0;
    }
    std::unique_ptr<Backend> backend;
    start_up_begins();
    Status made = make_backend(&c, c.elastic_round >= 0 ? c.elastic_round : generation, &backend);
    start_up_ends();
    if (!made.ok()) return report(made);
    // Counted once the backend exists, so that an init retried after the
    // failure below meets its peers under new names.
    ++generation;
    // Every control message carries the response cache's two bit vectors;
    // they may take at most half of it, the rest being for requests. Every
    // rank has the same settings and sizes, so all refuse alike.
    const size_t room = backend->max_message_bytes(), cache_bits = 64 + (size_t)c.cache_capacity / 4;
    if (cache_bits > room / 2)
      return report(Status::Error(
          UNISON_ERR_INVALID_ARGUMENT,
          "unison: UNISON_CACHE_CAPACITY=" + std::to_string(c.cache_capacity) + " needs " +
              std::to_string(cache_bits) + " bytes of every control message, but with UNISON_CONTROL_MESSAGE_BYTES=" +
              std::to_string(c.control_message_bytes) + " on " + std::to_string(c.size) +
              " ranks a message holds " + std::to_string(room) +
              ": lower the first or raise the second (at most half a message goes to the cache)"));
    // After the backend: under mpirun the local rank is MPI's answer.
    Status pinned = c.choose_engine_core();
    if (!pinned.ok()) return report(pinned);
    config = c;
    std::atomic_store(&engine, std::make_shared<Engine>(c, std::move(backend), &handles));
    return UNISON_OK;
  });
}

int unison_check_settings(const char* const* names, const char* const* values, int count) {
  return guarded("unison_check_settings", [&]() -> int {
    if (count < 0 || (count > 0 && (names == nullptr || values == nullptr)))
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: check_settings needs count names and values"));
    std::unordered_map<std::string, std::string> given;
    for (int i = 0; i < count; ++i) {
      if (names[i] == nullptr || values[i] == nullptr)
        return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: check_settings: a NULL name or value"));
      given[names[i]] = values[i];
    }
    const Variables variables = [&given](const char* name) -> const char* {
      const auto found = given.find(name);
      return found == given.end() ? nullptr : found->second.c_str();
    };
    Config parsed;
    return report(Config::from_variables(variables, &parsed));
  });
}

const unison_setting* unison_setting_at(int index) {
  static const std::vector<unison_setting> rows = [] {
    std::vector<unison_setting> out;
    for (const SettingInfo& s : setting_table())
      out.push_back({s.name, s.horovod_name, s.kind, s.minimum, s.maximum, s.choices, s.default_value.c_str(),
                     s.description, s.flag, s.flag_unit, s.config_key});
    return out;
  }();
  return index >= 0 && (size_t)index < rows.size() ? &rows[index] : nullptr;
}

int unison_shutdown(void) {
  if (forked_from != 0) return UNISON_OK;  // the rank lives on in its own process
  std::lock_guard<std::mutex> lock(lifecycle_mutex);
  std::shared_ptr<Engine> stopping = std::atomic_exchange(&engine, std::shared_ptr<Engine>());
  if (stopping != nullptr) stopping->stop();
  return UNISON_OK;
}

int unison_is_initialized(void) { return engine != nullptr ? 1 : 0; }

void unison_abort_start(const char* reason) { abort_start_up(reason != nullptr ? reason : "aborted"); }

int unison_start_timeline(const char* path, int mark_cycles) {
  return guarded("unison_start_timeline", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    std::lock_guard<std::mutex> lock(lifecycle_mutex);
    if (engine == nullptr) return not_initialized();
    if (path == nullptr || *path == '\0')
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: start_timeline needs a file name"));
    return report(engine->start_timeline(path, mark_cycles != 0));
  });
}

int unison_tuned_settings(int64_t* fusion_threshold_bytes, double* cycle_time_ms, int* cache, int* hierarchical,
                          int* settled) {
  if (forked_from != 0) return refuse_in_forked_child();
  std::lock_guard<std::mutex> lock(lifecycle_mutex);
  if (engine == nullptr) return not_initialized();
  if (!fusion_threshold_bytes || !cycle_time_ms || !cache || !hierarchical || !settled)
    return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: NULL output pointer"));
  const TunedSettings s = engine->settings();
  *fusion_threshold_bytes = (int64_t)s.fusion_threshold_bytes;
  *cycle_time_ms = s.cycle_time_ms;
  *cache = s.cache ? 1 : 0;
  *hierarchical = s.hierarchical ? 1 : 0;
  *settled = s.settled ? 1 : 0;
  return UNISON_OK;
}

int unison_stop_timeline(void) {
  if (forked_from != 0) return refuse_in_forked_child();
  std::lock_guard<std::mutex> lock(lifecycle_mutex);
  if (engine == nullptr) return not_initialized();
  engine->stop_timeline();
  return UNISON_OK;
}

int unison_rank(int* out) { return query(out, config.rank); }
int unison_size(int* out) { return query(out, config.size); }
int unison_local_rank(int* out) { return query(out, config.local_rank); }
int unison_local_size(int* out) { return query(out, config.local_size); }
int unison_cross_rank(int* out) { return query(out, config.cross_rank); }
int unison_cross_size(int* out) { return query(out, config.cross_size); }
int unison_is_homogeneous(int* out) { return query(out, config.homogeneous ? 1 : 0); }
int unison_mpi_enabled(int* out) { return query(out, mpi_carries_job(config) ? 1 : 0); }
int unison_mpi_threads_supported(int* out) {
  return query(out, mpi_carries_job(config) && mpi_lets_every_thread_call() ? 1 : 0);
}

const char* unison_backend_name(void) { return engine != nullptr ? engine->backend().name() : ""; }

const char* unison_built_backends(void) {
  static const std::string names = built_backends();
  return names.c_str();
}

const char* unison_device_support(void) {
  static const std::string report = unison::device_support_report();
  return report.c_str();
}

int unison_enqueue(const unison_op_options* options, unison_handle* out) {
  return guarded("unison_enqueue", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    if (engine == nullptr) return not_initialized();
    if (options == nullptr || out == nullptr)
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: NULL options or handle pointer"));
    if (options->op == UNISON_ADD_PROCESS_SET || options->op == UNISON_REMOVE_PROCESS_SET)
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                                  "unison: process sets are added and removed with unison_add_process_set and "
                                  "unison_remove_process_set"));
    return report(engine->enqueue(*options, out));
  });
}

int unison_group_begin(void) {
  if (forked_from != 0) return refuse_in_forked_child();
  if (engine == nullptr) return not_initialized();
  engine->group_begin();
  return UNISON_OK;
}

int unison_group_end(int discard) {
  if (engine != nullptr && forked_from == 0) engine->group_end(discard != 0);
  return UNISON_OK;
}

int unison_graph_node_begin(int64_t waiting_thread) {
  caller_activity::graph_node_begin(waiting_thread);
  return UNISON_OK;
}

int unison_graph_node_end(void) {
  caller_activity::graph_node_end();
  return UNISON_OK;
}

namespace {

// Runs one process-set op through negotiation and waits for it.
int run_process_set_op(unison_op_options* options, int* process_set_id) {
  if (forked_from != 0) return refuse_in_forked_child();
  if (engine == nullptr) return not_initialized();
  unison_handle handle = 0;
  Status s = engine->enqueue(*options, &handle);
  if (!s.ok()) return report(s);
  s = engine->wait(handle, -1.0);
  if (s.ok() && process_set_id != nullptr)
    s = handles.with_result(handle, [&](const Status&, const OpResult& result) { *process_set_id = result.process_set_id; });
  handles.release(handle);
  return report(s);
}

}  // namespace

int unison_add_process_set(const int* ranks, int nranks, int* process_set_id) {
  return guarded("unison_add_process_set", [&]() -> int {
    if (ranks == nullptr || nranks < 1 || process_set_id == nullptr)
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: add_process_set needs at least one rank"));
    std::vector<int64_t> members(ranks, ranks + nranks);
    unison_op_options options = {};
    options.name = "process_set.add";
    options.op = UNISON_ADD_PROCESS_SET;
    options.splits = members.data();
    options.nsplits = nranks;
    options.device = UNISON_CPU_DEVICE;
    return run_process_set_op(&options, process_set_id);
  });
}

int unison_remove_process_set(int process_set_id) {
  return guarded("unison_remove_process_set", [&]() -> int {
    unison_op_options options = {};
    options.name = "process_set.remove";
    options.op = UNISON_REMOVE_PROCESS_SET;
    options.root_rank = process_set_id;
    options.device = UNISON_CPU_DEVICE;
    return run_process_set_op(&options, nullptr);
  });
}

int unison_poll(unison_handle handle, int* done) {
  return guarded("unison_poll", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    bool d = false;
    Status s = handles.poll(handle, &d);
    if (s.ok() && done != nullptr) *done = d ? 1 : 0;
    if (s.ok() && !d)
      if (std::shared_ptr<Engine> current = std::atomic_load(&engine)) current->claim_for_poll();
    return report(s);
  });
}

int unison_wait(unison_handle handle, double timeout_seconds) {
  return guarded("unison_wait", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    std::shared_ptr<Engine> current = std::atomic_load(&engine);
    if (current == nullptr) return report(handles.wait(handle, timeout_seconds));
    return report(current->wait(handle, timeout_seconds));
  });
}

int unison_wait_release(unison_handle handle, double timeout_seconds) {
  return guarded("unison_wait_release", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    std::shared_ptr<Engine> current = std::atomic_load(&engine);
    if (current == nullptr) return report(handles.wait(handle, timeout_seconds, true));
    return report(current->wait(handle, timeout_seconds, true));
  });
}

int unison_handle_error(unison_handle handle, char* buffer, int64_t capacity) {
  return guarded("unison_handle_error", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    if (buffer == nullptr || capacity <= 0)
      return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: no buffer for the error message"));
    return report(handles.with_result(handle, [&](const Status& status, const OpResult&) {
      std::strncpy(buffer, status.message.c_str(), (size_t)capacity - 1);
      buffer[capacity - 1] = '\0';
    }));
  });
}

int unison_handle_result(unison_handle handle, int take_ownership, void** data, int64_t* nbytes,
                         int* ndim, int64_t* shape) {
  return guarded("unison_handle_result", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    return report(handles.with_result(handle, [&](const Status&, const OpResult& const_result) {
      OpResult& result = const_cast<OpResult&>(const_result);
      if (data) *data = result.data;
      if (nbytes) *nbytes = result.bytes;
      if (ndim) *ndim = (int)result.shape.size();
      if (shape)
        for (size_t i = 0; i < result.shape.size() && i < UNISON_MAX_DIMS; ++i) shape[i] = result.shape[i];
      if (take_ownership && result.core_allocated) result.core_allocated = false;
    }));
  });
}

int unison_handle_received_splits(unison_handle handle, int64_t* splits, int n) {
  return guarded("unison_handle_received_splits", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    return report(handles.with_result(handle, [&](const Status&, const OpResult& result) {
      for (int i = 0; i < n && i < (int)result.received_splits.size(); ++i) splits[i] = result.received_splits[i];
    }));
  });
}

int unison_handle_join_rank(unison_handle handle, int* last_rank) {
  if (forked_from != 0) return refuse_in_forked_child();
  return report(handles.with_result(handle, [&](const Status&, const OpResult& result) {
    if (last_rank) *last_rank = result.join_rank;
  }));
}

int unison_handle_unused(unison_handle handle, int* unused) {
  if (forked_from != 0) return refuse_in_forked_child();
  return report(handles.with_result(handle, [&](const Status&, const OpResult& result) {
    if (unused) *unused = result.unused_everywhere ? 1 : 0;
  }));
}

int unison_release(unison_handle handle) {
  if (forked_from != 0) return refuse_in_forked_child();
  return report(handles.release(handle));
}

int unison_on_done(unison_handle handle, unison_done_fn done, void* arg) {
  return guarded("unison_on_done", [&]() -> int {
    if (forked_from != 0) return refuse_in_forked_child();
    if (done == nullptr) return report(Status::Error(UNISON_ERR_INVALID_ARGUMENT, "unison: unison_on_done needs a function"));
    Status s = handles.on_done(handle, done, arg);
    // Nobody will wait to drive it: the engine's thread takes it now.
    if (s.ok())
      if (std::shared_ptr<Engine> current = std::atomic_load(&engine)) current->claim_for_poll();
    return report(s);
  });
}

int unison_set_waiter_finder(unison_waiter_finder finder) {
  caller_activity::set_waiter_finder(finder);
  return UNISON_OK;
}

void unison_free(void* data) { unison::free_result_memory(data); }

const char* unison_last_error(void) { return last_error.c_str(); }

}  // extern "C"
