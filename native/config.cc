#include "config.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

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

// A number in [minimum, maximum], said the same way in every refusal.
std::string range_text(double minimum, double maximum, const char* what) {
  char text[160];
  std::snprintf(text, sizeof(text), "%s from %.15g to %.15g", what, minimum, maximum);
  return text;
}

Status read_int(const Variables& env, int* field, const char* unison_name, const char* horovod_name = nullptr,
                double minimum = 0, double maximum = INT32_MAX) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed(v);
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || parsed < minimum || parsed > maximum)
    return bad_setting(name, v, range_text(minimum, maximum, "an integer"));
  *field = (int)parsed;
  return Status::OK();
}

// A byte count: digits, then optionally a unit. KB, MB and GB are powers of
// 1000 and KiB, MiB and GiB powers of 1024, as the units say; a bare K, M or
// G means the binary one, as ulimit and dd read it. Case does not matter.
Status read_size(const Variables& env, size_t* field, const char* unison_name, const char* horovod_name,
                 double minimum, double maximum) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string expected =
      range_text(minimum, maximum, "a size in bytes") + " (such as 67108864, 64MiB or 64MB)";
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
  // Both bounds are far below 2^64, so the product is compared only when it
  // cannot have wrapped.
  if (count > (unsigned long long)maximum / multiplier || (double)(count * multiplier) < minimum)
    return bad_setting(name, v, expected);
  *field = (size_t)(count * multiplier);
  return Status::OK();
}

Status read_double(const Variables& env, double* field, const char* unison_name, const char* horovod_name,
                   double minimum, double maximum) {
  const char* name = nullptr;
  const char* v = lookup(env, unison_name, horovod_name, &name);
  if (v == nullptr) return Status::OK();
  const std::string text = trimmed(v);
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(parsed) || parsed < minimum || parsed > maximum)
    return bad_setting(name, v, range_text(minimum, maximum, "a number"));
  *field = parsed;
  return Status::OK();
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

namespace {

// Every setting the core reads, in the order init reads them (the first bad
// one is the one reported). This table is the only place a setting's name,
// Horovod alias, kind, bounds, launcher option and config-file key are
// written; its default is Config's member initializer (config.h). The
// launcher's options, their --help and its config file, its checks, and the
// docs' settings page read it through unison_setting_at().
//
// Why each range: rank counts stop at a million, more than any job runs,
// so that every per-rank table stays allocatable and every product of a
// count and a small size fits in 64 bits. Times stop where a longer one can
// only be a typo (a cycle of 10 s, a week of stalling) and would otherwise
// hang a job that could have failed. Shared memory per rank stops at 1 GiB
// a slot and 64 MiB of control messages (each is mapped several times, so
// 5G once asked for 20 GiB of /dev/shm). A peer timeout of 0 would declare
// every peer dead at once. Secrets are at least 16 bytes, 128 bits, which
// no one guesses by trying.
constexpr double kMaxRanks = 1 << 20;
constexpr double kDay = 86400;
constexpr double kGiB = 1024.0 * 1024 * 1024;

using Target = std::variant<int Config::*, size_t Config::*, double Config::*, bool Config::*, std::string Config::*,
                            LogLevel Config::*, std::vector<int> Config::*>;

struct Setting {
  const char* name;
  const char* horovod_name;
  const char* kind;
  double minimum, maximum;
  const char* choices;
  Target target;
  const char* description;
  // The launcher's side (runner/command_line.py builds its options from
  // these): unisonrun's option for the setting, the unit that option takes
  // where it is not the variable's (MiB for a size in bytes), and the key
  // of horovodrun's config file. A flag option named --no-X sets the
  // variable to 1, and its config key is X's "enabled", the opposite.
  const char* flag = nullptr;
  const char* flag_unit = nullptr;
  const char* config_key = nullptr;
};

constexpr const char* kNone = nullptr;

const Setting kSettings[] = {
    {"UNISON_RANK", "HOROVOD_RANK", "integer", 0, kMaxRanks - 1, kNone, &Config::rank,
     "This process's rank in the job (set by the launcher)."},
    {"UNISON_SIZE", "HOROVOD_SIZE", "integer", 1, kMaxRanks, kNone, &Config::size,
     "How many ranks the job has (set by the launcher)."},
    {"UNISON_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "integer", 0, kMaxRanks - 1, kNone, &Config::local_rank,
     "This process's rank among the ranks of its host (set by the launcher)."},
    {"UNISON_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "integer", 1, kMaxRanks, kNone, &Config::local_size,
     "How many ranks run on this host (set by the launcher)."},
    {"UNISON_CROSS_RANK", "HOROVOD_CROSS_RANK", "integer", 0, kMaxRanks - 1, kNone, &Config::cross_rank,
     "This host's place among the hosts (set by the launcher)."},
    {"UNISON_CROSS_SIZE", "HOROVOD_CROSS_SIZE", "integer", 1, kMaxRanks, kNone, &Config::cross_size,
     "How many hosts run a rank with this local rank (set by the launcher)."},
    {"UNISON_JOB_ID", kNone, "text", 0, 0, kNone, &Config::job_id,
     "Names the job's shared memory (set by the launcher)."},
    {"UNISON_ELASTIC_ROUND", kNone, "integer", 0, 1 << 30, kNone, &Config::elastic_round,
     "The round of an elastic job (set by the elastic driver)."},
    {"UNISON_HOSTNAME", "HOROVOD_HOSTNAME", "text", 0, 0, kNone, &Config::hostname,
     "This rank's host, for deciding which ranks share memory; gethostname() where unset."},
    {"UNISON_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "text", 0, 0, kNone, &Config::rendezvous_host,
     "Across hosts without MPI: the address rank 0 listens on (set by the launcher)."},
    {"UNISON_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT", "integer", 1, 65535, kNone, &Config::rendezvous_port,
     "Across hosts without MPI: the port rank 0 listens on (set by the launcher)."},
    {"UNISON_SECRET_KEY", kNone, "secret", 16, 0, kNone, &Config::secret_key,
     "The job's secret, which every connection between ranks must prove (set by the launcher)."},
    {"UNISON_NETWORK_INTERFACE", "HOROVOD_GLOO_IFACE", "text", 0, 0, kNone, &Config::network_interface,
     "The interface (name or IPv4 address) the ranks listen on, 0.0.0.0 for all; where unset, the one that "
     "reaches rank 0."},
    {"UNISON_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE", "flag", 0, 0, kNone, &Config::hierarchical,
     "Across hosts: shared memory within each host and TCP or MPI between hosts (1), or TCP or MPI "
     "between every pair of ranks (0). For GPU tensors: NCCL within each host and the CPU plane "
     "between hosts (1), or one NCCL communicator over every rank (0).",
     "--hierarchical-allreduce", kNone, "params.hierarchical_allreduce"},
    {"UNISON_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", "bytes", 0, 16 * kGiB, kNone,
     &Config::fusion_threshold_bytes,
     "Ready allreduces are packed into one collective up to this many bytes.",
     "--fusion-threshold-mb", "MiB", "params.fusion_threshold_mb"},
    {"UNISON_CYCLE_TIME", "HOROVOD_CYCLE_TIME", "number", 0, 10000, kNone, &Config::cycle_time_ms,
     "Milliseconds between negotiation cycles: 0 starts one the moment work arrives; a positive value "
     "batches like Horovod's cycle time.",
     "--cycle-time-ms", kNone, "params.cycle_time_ms"},
    {"UNISON_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY", "integer", 0, 1 << 20, kNone, &Config::cache_capacity,
     "Negotiated tensors remembered, so that steady-state steps agree through one bit each; 0 turns "
     "the cache off.",
     "--cache-capacity", kNone, "params.cache_capacity"},
    {"UNISON_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE", "flag", 0, 0, kNone,
     &Config::stall_check_disabled, "Turns the stall inspector off.",
     "--no-stall-check", kNone, "stall_check.enabled"},
    {"UNISON_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS", "number", 0, 7 * kDay, kNone,
     &Config::stall_warning_seconds,
     "Seconds a tensor may wait for other ranks before a warning names them; when every rank is "
     "blocked this long, they fail as a deadlock.",
     "--stall-check-warning-time-seconds", kNone, "stall_check.warning_time_seconds"},
    {"UNISON_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "number", 0, 7 * kDay, kNone,
     &Config::stall_shutdown_seconds,
     "Seconds after which a stalled tensor fails; 0 never fails it.",
     "--stall-check-shutdown-time-seconds", kNone, "stall_check.shutdown_time_seconds"},
    {"UNISON_PEER_TIMEOUT_SECONDS", kNone, "number", 0.1, kDay, kNone, &Config::peer_timeout_seconds,
     "Seconds a peer may show no sign of life before it is declared failed; once a failure has stopped "
     "a rank, GPU work it still has queued gets this long to finish before it is aborted.",
     "--peer-timeout-seconds", kNone, kNone},
    {"UNISON_START_TIMEOUT", "HOROVOD_START_TIMEOUT", "number", 0.1, kDay, kNone, &Config::start_timeout_seconds,
     "Seconds init waits for every rank to arrive.",
     "--start-timeout", kNone, "library_options.gloo_timeout_seconds"},
    {"UNISON_SHM_SLOT_BYTES", kNone, "bytes", 4096, kGiB, kNone, &Config::shm_slot_bytes,
     "Shared-memory staging per rank, in two halves: a larger collective moves in rounds of a half "
     "(benchmarks/round_size.py compares sizes on your machine). With its two control mailboxes a "
     "rank takes 4 MiB of /dev/shm by default, and as much again per process set it is in, reserved "
     "at init: a /dev/shm too small is an error at init giving both figures, not a SIGBUS mid-training."},
    {"UNISON_CONTROL_MESSAGE_BYTES", kNone, "bytes", 4096, 64 * 1024 * 1024, kNone, &Config::control_message_bytes,
     "The largest negotiation message: requests and responses that do not fit wait for the next "
     "cycles. Within a host each rank has two such mailboxes in shared memory."},
    {"UNISON_SMALL_ALLREDUCE_BYTES", kNone, "bytes", 0, kGiB, kNone, &Config::small_allreduce_bytes,
     "Reductions up to this size are done whole by every rank instead of split across them."},
    {"UNISON_SPIN_MICROSECONDS", kNone, "number", 0, 1e6, kNone, &Config::spin_microseconds,
     "How long a waiting thread checks for its peers before it sleeps in the kernel."},
    {"UNISON_SPIN_YIELD", kNone, "auto-or-flag", 0, 0, kNone, &Config::spin_yield,
     "Whether spinning yields the core at every check (sched_yield) rather than holding it (pause), "
     "since the rank waited for may be queued on it; auto yields where a host's ranks outnumber the "
     "cores a process may run on (3 ranks on 2 cores: a 4 KiB allreduce took 150 us holding, 34-49 us "
     "yielding)."},
    {"UNISON_OVERLAP", kNone, "auto-or-flag", 0, 0, kNone, &Config::overlap,
     "Whether an async op starts at once on the engine's thread, overlapping the caller's compute (1), "
     "or waits for a caller's wait, which runs it on its own thread (0); auto starts at once where the "
     "host has more usable cores than ranks (native/engine_driver.cc)."},
    {"UNISON_GPU_DATA_PLANE", kNone, "choice", 0, 0, "auto|nccl|staging", &Config::gpu_data_plane,
     "How GPU tensors move: NCCL where every rank of a set has its own GPU and NCCL loads, else staged "
     "through host memory (auto); NCCL or an error (nccl); always through host memory (staging)."},
    {"UNISON_LOG_LEVEL", "HOROVOD_LOG_LEVEL", "choice", 0, 0, "trace|debug|info|warning|error|fatal",
     &Config::log_level,
     "The least severe message the core prints, in Horovod's names and any case: trace, debug, info "
     "and warning print its warnings (it has no info or debug messages), error silences them, fatal "
     "its errors too; exceptions reach the caller either way.",
     "--log-level", kNone, "logging.level"},
    {"UNISON_THREAD_AFFINITY", "HOROVOD_THREAD_AFFINITY", "core-list", 0, CPU_SETSIZE - 1, kNone,
     &Config::thread_affinity, "Comma-separated cores, one per local rank, to pin each rank's engine thread to.",
     "--thread-affinity", kNone, kNone},
    {"UNISON_TIMELINE", "HOROVOD_TIMELINE", "path", 0, 0, kNone, &Config::timeline_path,
     "Rank 0 writes a timeline (a Chrome trace of every tensor's phases) to this file.",
     "--timeline-filename", kNone, "timeline.filename"},
    {"UNISON_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES", "flag", 0, 0, kNone,
     &Config::timeline_mark_cycles, "Marks each negotiation cycle on the timeline.",
     "--timeline-mark-cycles", kNone, "timeline.mark_cycles"},
    {"UNISON_AUTOTUNE", "HOROVOD_AUTOTUNE", "flag", 0, 0, kNone, &Config::autotune,
     "Rank 0 searches the fusion threshold, cycle time, cache and hierarchical allreduce for the "
     "fastest during the first steps, and every rank switches at one cycle.",
     "--autotune", kNone, "autotune.enabled"},
    {"UNISON_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG", "path", 0, 0, kNone, &Config::autotune_log,
     "A CSV file of every setting the autotuner tried and its score.",
     "--autotune-log-file", kNone, "autotune.log_file"},
    {"UNISON_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "integer", 0, 1000, kNone,
     &Config::autotune_warmup_samples, "Samples the autotuner discards before scoring.",
     "--autotune-warmup-samples", kNone, "autotune.warmup_samples"},
    {"UNISON_AUTOTUNE_SAMPLES", kNone, "integer", 1, 1000, kNone, &Config::autotune_samples,
     "Samples the autotuner scores each setting by."},
    {"UNISON_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "integer", 1, 1e6, kNone,
     &Config::autotune_steps_per_sample, "Steps in one autotuner sample.",
     "--autotune-steps-per-sample", kNone, "autotune.steps_per_sample"},
    {"UNISON_AUTOTUNE_CACHE", kNone, "flag", 0, 0, kNone, &Config::autotune_cache,
     "Whether the autotuner tries the response cache on and off; 0 leaves it as it is."},
    {"UNISON_TORCH_FAST_PATH", kNone, "auto-or-flag", 0, 0, kNone, &Config::torch_fast_path,
     "Whether unison.torch starts in-place allreduces (every gradient's) through its compiled extension, built "
     "against the installed torch at first import and cached: auto uses it where it builds and warns once, "
     "saying why, where it does not; 1 makes a failed build an error; 0 keeps to the Python path."},
    {"UNISON_TF_KERNELS", kNone, "auto-or-flag", 0, 0, kNone, &Config::tf_kernels,
     "Whether unison.tensorflow runs collectives inside tf.function and TF1 graphs as its compiled asynchronous "
     "op kernels, built against the installed TensorFlow at first import and cached: auto uses them where they "
     "build and warns once, saying why, where they do not; 1 makes a failed build an error; 0 keeps to "
     "tf.py_function nodes."},
    {"UNISON_CACHE_DIR", kNone, "path", 0, 0, kNone, &Config::cache_dir,
     "The folder where compiled adapter extensions are kept, one per framework version and compiler flags; "
     "unset: $XDG_CACHE_HOME/unison, else ~/.cache/unison. It must belong to this user and be writable by no "
     "one else, since what it holds is loaded into the process."},
};

Status read_choice(const Variables& env, const Setting& s, std::string* word) {
  const char* name = nullptr;
  const char* v = lookup(env, s.name, s.horovod_name, &name);
  if (v == nullptr) return Status::OK();
  // Horovod's level names come in any case (HOROVOD_LOG_LEVEL=debug is common).
  const std::string text = trimmed_lower(v);
  const std::string choices = s.choices;
  for (size_t at = 0; at <= choices.size();) {
    const size_t bar = std::min(choices.find('|', at), choices.size());
    if (text == choices.substr(at, bar - at)) {
      *word = text;
      return Status::OK();
    }
    at = bar + 1;
  }
  std::string listed = choices;
  for (size_t bar = listed.find('|'); bar != std::string::npos; bar = listed.find('|', bar))
    listed.replace(bar, 1, ", ");
  return bad_setting(name, v, "one of " + listed);
}

Status read_secret(const Variables& env, const Setting& s, std::string* field) {
  const char* v = lookup(env, s.name, s.horovod_name);
  if (v == nullptr) return Status::OK();
  // The value itself is never repeated in an error: it is a secret.
  if (std::strlen(v) < (size_t)s.minimum)
    return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                         std::string("unison: ") + s.name + " is " + std::to_string(std::strlen(v)) +
                             " bytes long; a secret must have at least " + std::to_string((int)s.minimum) +
                             " (unisonrun makes one of 32 random bytes, in 64 hex digits)");
  *field = v;
  return Status::OK();
}

Status read_setting(const Variables& env, const Setting& s, Config* c) {
  const std::string kind = s.kind;
  if (kind == "integer") return read_int(env, &(c->*std::get<int Config::*>(s.target)), s.name, s.horovod_name,
                                         s.minimum, s.maximum);
  if (kind == "bytes") return read_size(env, &(c->*std::get<size_t Config::*>(s.target)), s.name, s.horovod_name,
                                        s.minimum, s.maximum);
  if (kind == "number") return read_double(env, &(c->*std::get<double Config::*>(s.target)), s.name,
                                           s.horovod_name, s.minimum, s.maximum);
  if (kind == "flag") return read_flag(env, &(c->*std::get<bool Config::*>(s.target)), s.name, s.horovod_name);
  if (kind == "auto-or-flag") return read_auto_or_flag(env, &(c->*std::get<int Config::*>(s.target)), s.name);
  if (kind == "secret") return read_secret(env, s, &(c->*std::get<std::string Config::*>(s.target)));
  if (kind == "core-list")
    return read_core_list(env, &(c->*std::get<std::vector<int> Config::*>(s.target)), &c->thread_affinity_setting,
                          s.name, s.horovod_name);
  if (kind == "choice") {
    std::string word;
    Status read = read_choice(env, s, &word);
    if (!read.ok() || word.empty()) return read;
    if (std::holds_alternative<LogLevel Config::*>(s.target)) {
      static const char* const kLevels[] = {"trace", "debug", "info", "warning", "error", "fatal"};
      for (int level = 0; level < 6; ++level)
        if (word == kLevels[level]) c->*std::get<LogLevel Config::*>(s.target) = (LogLevel)level;
    } else {
      c->*std::get<std::string Config::*>(s.target) = word;
    }
    return Status::OK();
  }
  // text, and path: a file's name (the launcher makes it absolute, as the ranks may run elsewhere)
  if (const char* v = lookup(env, s.name, s.horovod_name)) c->*std::get<std::string Config::*>(s.target) = trimmed(v);
  return Status::OK();
}

std::string default_text(const Setting& s) {
  const Config defaults;
  char text[64];
  return std::visit(
      [&](auto member) -> std::string {
        using Value = std::decay_t<decltype(defaults.*member)>;
        const Value& value = defaults.*member;
        if constexpr (std::is_same_v<Value, bool>) {
          return value ? "1" : "0";
        } else if constexpr (std::is_same_v<Value, int>) {
          if (std::string(s.kind) == "auto-or-flag" && value < 0) return "auto";
          // Outside its range, the member's initial value means "not set"
          // (no elastic round, no rendezvous port).
          return value < s.minimum || value > s.maximum ? "" : std::to_string(value);
        } else if constexpr (std::is_same_v<Value, size_t>) {
          return std::to_string(value);
        } else if constexpr (std::is_same_v<Value, double>) {
          std::snprintf(text, sizeof(text), "%g", value);
          return text;
        } else if constexpr (std::is_same_v<Value, std::string>) {
          return value;
        } else if constexpr (std::is_same_v<Value, LogLevel>) {
          static const char* const kLevels[] = {"trace", "debug", "info", "warning", "error", "fatal"};
          return kLevels[(int)value];
        } else {
          return "";
        }
      },
      s.target);
}

}  // namespace

const std::vector<SettingInfo>& setting_table() {
  static const std::vector<SettingInfo> table = [] {
    std::vector<SettingInfo> rows;
    for (const Setting& s : kSettings)
      rows.push_back({s.name, s.horovod_name, s.kind, s.minimum, s.maximum, s.choices, default_text(s),
                      s.description, s.flag, s.flag_unit, s.config_key});
    return rows;
  }();
  return table;
}

Status Config::from_variables(const Variables& env, Config* out) {
  Config c;
  Settings read;
  // An MPI launcher's or srun's identity, where unisonrun gave none; the
  // table's UNISON_* variables win over it.
  if (lookup(env, "UNISON_RANK", "HOROVOD_RANK") == nullptr) read(read_launcher_identity(env, &c));
  for (const Setting& s : kSettings) read(read_setting(env, s, &c));
  // Without a launcher's word for it, a job is one host.
  if (c.mpi_launcher.empty()) {
    if (lookup(env, "UNISON_LOCAL_RANK", "HOROVOD_LOCAL_RANK") == nullptr) c.local_rank = c.rank;
    if (lookup(env, "UNISON_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE") == nullptr) c.local_size = c.size;
  }
  const bool has_host = !c.rendezvous_host.empty(), has_port = c.rendezvous_port != 0;
  if (has_host != has_port)
    read(Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                       std::string("unison: UNISON_RENDEZVOUS_ADDR and UNISON_RENDEZVOUS_PORT go together, and only ") +
                           (has_host ? "UNISON_RENDEZVOUS_ADDR" : "UNISON_RENDEZVOUS_PORT") + " is set"));
  else if (has_host)
    c.rendezvous_address = c.rendezvous_host + ":" + std::to_string(c.rendezvous_port);
  if (!c.rendezvous_address.empty() && c.secret_key.empty())
    read(Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                       "unison: UNISON_RENDEZVOUS_ADDR is set but UNISON_SECRET_KEY is not: ranks across hosts only "
                       "accept connections that prove the job's secret (unisonrun -H sets both)"));
  c.stall_check_enabled = !c.stall_check_disabled;
  c.spin_yields_core = c.spin_yield < 0 ? c.local_size > usable_cores() : c.spin_yield == 1;
  c.fusion_threshold_fixed = lookup(env, "UNISON_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD") != nullptr;
  c.cycle_time_fixed = lookup(env, "UNISON_CYCLE_TIME", "HOROVOD_CYCLE_TIME") != nullptr;
  c.cache_fixed = lookup(env, "UNISON_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY") != nullptr;
  c.hierarchical_fixed = lookup(env, "UNISON_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE") != nullptr;
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
