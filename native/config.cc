#include "config.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

namespace unison {
namespace {

// The first of the names that is set, or nullptr; *which says which one, so
// that an error names the variable the user actually wrote.
const char* lookup(const Variables& env, const char* unison_name, const char* horovod_name,
                   const char** which = nullptr) {
  const char* name = unison_name;
  const char* value = env(unison_name);
  if ((value == nullptr || *value == '\0') && horovod_name != nullptr) {
    name = horovod_name;
    value = env(horovod_name);
  }
  if (which != nullptr) *which = name;
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

// Every setting is either understood completely or rejected: a value that
// only starts like a number ("64MB" read as 64, "abc" read as 0) would run
// the job with a setting nobody asked for, which is worse than not starting.
Status bad_setting(const char* name, const char* value, const std::string& expected) {
  return Status::Error(UNISON_ERR_INVALID_ARGUMENT, std::string("unison: ") + name + "='" + value +
                                                        "' is not " + expected);
}

std::string trimmed(const char* value) {
  std::string s(value);
  const size_t first = s.find_first_not_of(" \t");
  const size_t last = s.find_last_not_of(" \t");
  return first == std::string::npos ? std::string() : s.substr(first, last - first + 1);
}

// trimmed(), in lower case: for the settings whose words may come in any case.
std::string trimmed_lower(const char* value) {
  std::string s = trimmed(value);
  for (char& ch : s) ch = (char)std::tolower((unsigned char)ch);
  return s;
}

Status read_int(const Variables& env, int* field, const char* unison_name, const char* horovod_name = nullptr,
                int minimum = 0) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed(v);
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || parsed < minimum || parsed > INT32_MAX)
    return bad_setting(name, v, "an integer of at least " + std::to_string(minimum));
  *field = (int)parsed;
  return Status::OK();
}

// A byte count: digits, then optionally a unit. KB, MB and GB are powers of
// 1000 and KiB, MiB and GiB powers of 1024, as the units say; a bare K, M or
// G means the binary one, as ulimit and dd read it. Case does not matter.
Status read_size(const Variables& env, size_t* field, const char* unison_name, const char* horovod_name = nullptr,
                 size_t minimum = 0) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string expected = "a size in bytes of at least " + std::to_string(minimum) +
                               " (such as 67108864, 64MiB or 64MB)";
  const std::string text = trimmed(v);
  size_t digits = 0;
  while (digits < text.size() && std::isdigit((unsigned char)text[digits])) ++digits;
  if (digits == 0 || digits > 18) return bad_setting(name, v, expected);
  const std::string unit = trimmed_lower(text.substr(digits).c_str());
  static const std::pair<const char*, unsigned long long> kUnits[] = {
      {"", 1ull},           {"b", 1ull},
      {"k", 1ull << 10},    {"kib", 1ull << 10},  {"kb", 1000ull},
      {"m", 1ull << 20},    {"mib", 1ull << 20},  {"mb", 1000000ull},
      {"g", 1ull << 30},    {"gib", 1ull << 30},  {"gb", 1000000000ull},
  };
  unsigned long long multiplier = 0;
  for (const auto& [spelling, factor] : kUnits)
    if (unit == spelling) multiplier = factor;
  if (multiplier == 0) return bad_setting(name, v, expected);
  const unsigned long long count = std::stoull(text.substr(0, digits));
  if (count > (unsigned long long)SIZE_MAX / multiplier || count * multiplier < minimum)
    return bad_setting(name, v, expected);
  *field = (size_t)(count * multiplier);
  return Status::OK();
}

Status read_double(const Variables& env, double* field, const char* unison_name, const char* horovod_name = nullptr) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed(v);
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(parsed) || parsed < 0)
    return bad_setting(name, v, "a non-negative number");
  *field = parsed;
  return Status::OK();
}

// Horovod's level names, in any case (HOROVOD_LOG_LEVEL=debug is common in
// Horovod jobs' environments).
Status read_log_level(const Variables& env, LogLevel* field) {
  const char* name = nullptr;
  const char* v = lookup(env, "UNISON_LOG_LEVEL", "HOROVOD_LOG_LEVEL", &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed_lower(v);
  const char* names[] = {"trace", "debug", "info", "warning", "error", "fatal"};
  for (int level = 0; level < 6; ++level)
    if (text == names[level]) {
      *field = (LogLevel)level;
      return Status::OK();
    }
  return bad_setting(name, v, "one of trace, debug, info, warning, error, fatal");
}

Status read_flag(const Variables& env, bool* field, const char* unison_name, const char* horovod_name = nullptr) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed_lower(v);
  if (text == "1" || text == "true" || text == "yes" || text == "on") {
    *field = true;
  } else if (text == "0" || text == "false" || text == "no" || text == "off") {
    *field = false;
  } else {
    return bad_setting(name, v, "a flag (1, 0, true, false, yes, no, on or off)");
  }
  return Status::OK();
}

// A setting that is `auto` or a flag: *field becomes -1 for auto, else 1 or 0.
Status read_auto_or_flag(const Variables& env, int* field, const char* name) {
  const char* v = lookup(env, name, nullptr);
  if (v == nullptr) return Status::OK();
  if (trimmed_lower(v) == "auto") {
    *field = -1;
    return Status::OK();
  }
  bool on = false;
  if (!read_flag(env, &on, name).ok())
    return bad_setting(name, v, "auto or a flag (1, 0, true, false, yes, no, on or off)");
  *field = on ? 1 : 0;
  return Status::OK();
}

// A comma-separated list of core numbers (HOROVOD_THREAD_AFFINITY's form).
Status read_core_list(const Variables& env, std::vector<int>* field, std::string* setting, const char* unison_name,
                      const char* horovod_name) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  std::vector<int> cores;
  const std::string text(v);
  size_t at = 0;
  while (true) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = trimmed(text.substr(at, comma - at).c_str());
    char* end = nullptr;
    errno = 0;
    const long parsed = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno == ERANGE || parsed < 0 || parsed >= CPU_SETSIZE)
      return bad_setting(name, v, "a comma-separated list of core numbers, one for each rank on the host");
    cores.push_back((int)parsed);
    if (comma == text.size()) break;
    at = comma + 1;
  }
  *field = std::move(cores);
  *setting = std::string(name) + "='" + v + "'";
  return Status::OK();
}

// Keeps the first failure of a sequence of reads, so that init reports the
// first bad setting and every read stays one line.
struct Settings {
  Status status;
  void operator()(Status next) {
    if (status.ok()) status = std::move(next);
  }
};

// Tasks on node `node` from SLURM's compressed list: "2(x3),1" is three
// nodes with 2 tasks, then one with 1.
int slurm_tasks_on_node(const std::string& list, int node) try {
  size_t at = 0;
  while (at < list.size()) {
    size_t used = 0;
    const int tasks = std::stoi(list.substr(at), &used);
    at += used;
    int repeat = 1;
    if (list.compare(at, 2, "(x") == 0) {
      repeat = std::stoi(list.substr(at + 2), &used);
      at += 2 + used + 1;  // past the ')'
    }
    if (node < repeat) return tasks;
    node -= repeat;
    at += 1;  // past the ','
  }
  return 0;
} catch (const std::exception&) {
  return 0;  // not SLURM's format: the MPI backend finds the real figure
}

// The identity an MPI launcher or srun gives its processes. MPI's own answer
// is what the job runs on; these tell init() which launcher it is under.
Status read_launcher_identity(const Variables& env, Config* c) {
  struct Launcher {
    const char *name, *rank, *size, *local_rank, *local_size;
  };
  static const Launcher kMpiLaunchers[] = {
      {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      // Hydra's PMI variables: MPICH, Intel MPI, MVAPICH.
      {"MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
  };
  Settings read;
  for (const Launcher& l : kMpiLaunchers) {
    if (lookup(env, l.rank, nullptr) == nullptr) continue;
    c->mpi_launcher = l.name;
    read(read_int(env, &c->rank, l.rank));
    read(read_int(env, &c->size, l.size, nullptr, 1));
    c->local_rank = c->rank, c->local_size = c->size;
    read(read_int(env, &c->local_rank, l.local_rank));
    read(read_int(env, &c->local_size, l.local_size, nullptr, 1));
    return read.status;
  }
  // srun, not the batch script: only a job step has SLURM_STEP_NUM_TASKS.
  if (lookup(env, "SLURM_STEP_NUM_TASKS", nullptr) != nullptr && lookup(env, "SLURM_PROCID", nullptr) != nullptr) {
    c->mpi_launcher = "SLURM";
    read(read_int(env, &c->rank, "SLURM_PROCID"));
    read(read_int(env, &c->size, "SLURM_STEP_NUM_TASKS", nullptr, 1));
    c->local_rank = c->rank, c->local_size = c->size;
    read(read_int(env, &c->local_rank, "SLURM_LOCALID"));
    int node = 0;
    read(read_int(env, &node, "SLURM_NODEID"));
    if (const char* list = lookup(env, "SLURM_STEP_TASKS_PER_NODE", nullptr))
      c->local_size = slurm_tasks_on_node(list, node);
  }
  return read.status;
}

}  // namespace

int usable_cores() {
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) return 1;
  return CPU_COUNT(&cpus);
}

Status Config::from_environment(Config* out) {
  return from_variables([](const char* name) -> const char* { return std::getenv(name); }, out);
}

Status Config::from_variables(const Variables& env, Config* out) {
  Config c;
  Settings read;
  if (lookup(env, "UNISON_RANK", "HOROVOD_RANK") == nullptr) read(read_launcher_identity(env, &c));
  read(read_int(env, &c.rank, "UNISON_RANK", "HOROVOD_RANK"));
  read(read_int(env, &c.size, "UNISON_SIZE", "HOROVOD_SIZE", 1));
  if (c.mpi_launcher.empty()) {
    c.local_rank = c.rank;
    c.local_size = c.size;
  }
  read(read_int(env, &c.local_rank, "UNISON_LOCAL_RANK", "HOROVOD_LOCAL_RANK"));
  read(read_int(env, &c.local_size, "UNISON_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", 1));
  read(read_int(env, &c.cross_rank, "UNISON_CROSS_RANK", "HOROVOD_CROSS_RANK"));
  read(read_int(env, &c.cross_size, "UNISON_CROSS_SIZE", "HOROVOD_CROSS_SIZE", 1));
  if (const char* v = lookup(env, "UNISON_JOB_ID", nullptr)) c.job_id = v;
  read(read_int(env, &c.elastic_round, "UNISON_ELASTIC_ROUND"));
  if (const char* v = lookup(env, "UNISON_HOSTNAME", "HOROVOD_HOSTNAME")) c.hostname = v;
  const char* rendezvous_host = lookup(env, "UNISON_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR");
  const char* rendezvous_port = lookup(env, "UNISON_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT");
  if ((rendezvous_host == nullptr) != (rendezvous_port == nullptr))
    read(Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                       std::string("unison: UNISON_RENDEZVOUS_ADDR and UNISON_RENDEZVOUS_PORT go together, and only ") +
                           (rendezvous_host ? "UNISON_RENDEZVOUS_ADDR" : "UNISON_RENDEZVOUS_PORT") + " is set"));
  else if (rendezvous_host != nullptr)
    c.rendezvous_address = trimmed(rendezvous_host) + ":" + trimmed(rendezvous_port);
  if (const char* v = lookup(env, "UNISON_SECRET_KEY", nullptr)) c.secret_key = v;
  if (!c.rendezvous_address.empty() && c.secret_key.empty())
    read(Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                       "unison: UNISON_RENDEZVOUS_ADDR is set but UNISON_SECRET_KEY is not: ranks across hosts only "
                       "accept connections that prove the job's secret (unisonrun -H sets both)"));
  if (const char* v = lookup(env, "UNISON_NETWORK_INTERFACE", "HOROVOD_GLOO_IFACE")) c.network_interface = trimmed(v);
  read(read_flag(env, &c.hierarchical, "UNISON_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE"));

  read(read_size(env, &c.fusion_threshold_bytes, "UNISON_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"));
  read(read_double(env, &c.cycle_time_ms, "UNISON_CYCLE_TIME", "HOROVOD_CYCLE_TIME"));
  read(read_int(env, &c.cache_capacity, "UNISON_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"));
  bool stall_check_disabled = false;
  read(read_flag(env, &stall_check_disabled, "UNISON_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"));
  c.stall_check_enabled = !stall_check_disabled;
  read(read_double(env, &c.stall_warning_seconds, "UNISON_STALL_CHECK_TIME_SECONDS",
                   "HOROVOD_STALL_CHECK_TIME_SECONDS"));
  read(read_double(env, &c.stall_shutdown_seconds, "UNISON_STALL_SHUTDOWN_TIME_SECONDS",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"));
  read(read_double(env, &c.peer_timeout_seconds, "UNISON_PEER_TIMEOUT_SECONDS"));
  read(read_double(env, &c.start_timeout_seconds, "UNISON_START_TIMEOUT", "HOROVOD_START_TIMEOUT"));
  // The shared-memory areas must hold at least a page each.
  read(read_size(env, &c.shm_slot_bytes, "UNISON_SHM_SLOT_BYTES", nullptr, 4096));
  read(read_size(env, &c.control_message_bytes, "UNISON_CONTROL_MESSAGE_BYTES", nullptr, 4096));
  read(read_size(env, &c.small_allreduce_bytes, "UNISON_SMALL_ALLREDUCE_BYTES"));
  read(read_double(env, &c.spin_microseconds, "UNISON_SPIN_MICROSECONDS"));
  int spin_yield = -1;
  read(read_auto_or_flag(env, &spin_yield, "UNISON_SPIN_YIELD"));
  c.spin_yields_core = spin_yield < 0 ? c.local_size > usable_cores() : spin_yield == 1;
  read(read_auto_or_flag(env, &c.overlap, "UNISON_OVERLAP"));
  if (const char* v = lookup(env, "UNISON_GPU_DATA_PLANE", nullptr)) {
    const std::string plane = trimmed(v);
    if (plane == "auto" || plane == "nccl" || plane == "staging")
      c.gpu_data_plane = plane;
    else
      read(bad_setting("UNISON_GPU_DATA_PLANE", v, "auto, nccl or staging"));
  }
  read(read_log_level(env, &c.log_level));
  read(read_core_list(env, &c.thread_affinity, &c.thread_affinity_setting, "UNISON_THREAD_AFFINITY",
                      "HOROVOD_THREAD_AFFINITY"));
  if (const char* v = lookup(env, "UNISON_TIMELINE", "HOROVOD_TIMELINE")) c.timeline_path = trimmed(v);
  read(read_flag(env, &c.autotune, "UNISON_AUTOTUNE", "HOROVOD_AUTOTUNE"));
  if (const char* v = lookup(env, "UNISON_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG")) c.autotune_log = trimmed(v);
  read(read_int(env, &c.autotune_warmup_samples, "UNISON_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"));
  read(read_int(env, &c.autotune_samples, "UNISON_AUTOTUNE_SAMPLES", nullptr, 1));
  read(read_int(env, &c.autotune_steps_per_sample, "UNISON_AUTOTUNE_STEPS_PER_SAMPLE",
                "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 1));
  read(read_flag(env, &c.autotune_cache, "UNISON_AUTOTUNE_CACHE"));
  c.fusion_threshold_fixed = lookup(env, "UNISON_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD") != nullptr;
  c.cycle_time_fixed = lookup(env, "UNISON_CYCLE_TIME", "HOROVOD_CYCLE_TIME") != nullptr;
  c.cache_fixed = lookup(env, "UNISON_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY") != nullptr;
  c.hierarchical_fixed = lookup(env, "UNISON_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE") != nullptr;
  read(read_flag(env, &c.timeline_mark_cycles, "UNISON_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES"));
  if (read.status.ok()) *out = c;
  return read.status;
}

Status Config::choose_engine_core() {
  engine_core = -1;
  if (thread_affinity.empty()) return Status::OK();
  const std::string setting = "unison: " + thread_affinity_setting;
  if ((int)thread_affinity.size() < local_size)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         setting + " names " + std::to_string(thread_affinity.size()) + " core(s), but this host runs " +
                             std::to_string(local_size) + " ranks: give one core for each");
  const int core = thread_affinity[local_rank];
  cpu_set_t usable;
  if (sched_getaffinity(0, sizeof(usable), &usable) == 0 && !CPU_ISSET(core, &usable)) {
    std::string list;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &usable)) list += (list.empty() ? "" : ",") + std::to_string(c);
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         setting + " gives local rank " + std::to_string(local_rank) + " core " +
                             std::to_string(core) + ", which this process may not run on (it may use " + list + ")");
  }
  engine_core = core;
  return Status::OK();
}

}  // namespace unison
