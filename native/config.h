// config.h: every knob of the core, read from the environment once at init.
//
// Each setting has a UNISON_* name; where Horovod has the same knob its
// HOROVOD_* name is accepted too, so an existing job script keeps working.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "log.h"
#include "status.h"

namespace unison {

// A variable's value by name, or nullptr where it is not set.
using Variables = std::function<const char*(const char*)>;

struct Config {
  // Identity, set by the launcher. A process started without it is rank 0 of 1.
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  // Whether every host runs as many ranks as every other (Horovod's
  // is_homogeneous). One host always does; a layout across hosts says.
  bool homogeneous = true;
  std::string job_id;
  // The round of an elastic job (UNISON_ELASTIC_ROUND, set by unisonrun's
  // driver), or -1. Ranks of one round have been through different numbers
  // of inits (survivors and newcomers), so the round, not each process's
  // own count, names the round's shared memory.
  int elastic_round = -1;

  // Which launcher's variables gave the identity when unisonrun did not:
  // "Open MPI", "MPICH" (any PMI-based mpirun: MPICH, Intel MPI, MVAPICH)
  // or "SLURM" (srun). Empty otherwise. Such a job gets its real identity
  // from MPI itself (mpi/world.cc).
  std::string mpi_launcher;

  // This rank's host identity for deciding which ranks share memory; empty
  // means gethostname(). Giving ranks of one machine different names makes
  // it pose as several hosts, which is how the cross-host paths are tested.
  std::string hostname;

  // Global ranks of this host's ranks, by local rank, so that a backend
  // working within one host names peers by their global rank. Empty when
  // the host is the whole job (local rank == rank).
  std::vector<int> host_ranks;

  // Across hosts without MPI (tcp/): where rank 0 listens ("host:port",
  // from UNISON_RENDEZVOUS_ADDR and UNISON_RENDEZVOUS_PORT), the job's
  // secret every connection must prove, and the interface (name or IPv4
  // address) to listen on; empty means the one that reaches rank 0.
  std::string rendezvous_address;
  std::string rendezvous_host;  // the two variables rendezvous_address is made of
  int rendezvous_port = 0;
  std::string secret_key;
  std::string network_interface;

  // Across hosts: shared memory within each host and MPI or TCP between them
  // (true), or MPI or TCP for every byte between every pair of ranks (false).
  // Hierarchical is the default because it is faster wherever a host runs
  // more than one rank (docs/design-notes.md); a job with one rank per host
  // runs flat either way.
  bool hierarchical = true;

  // Allreduces (and allgathers, reducescatters) ready in the same cycle are
  // packed together up to this many bytes. 64 MiB is Horovod's default: large
  // enough that a whole model's gradients usually go as one collective.
  size_t fusion_threshold_bytes = 64u << 20;

  // 0 (the default) starts a negotiation cycle the moment a request arrives,
  // so a lone small op pays no waiting. A positive value (milliseconds) makes
  // cycles start at most that often, batching more tensors per negotiation,
  // which is what Horovod's HOROVOD_CYCLE_TIME does.
  double cycle_time_ms = 0.0;

  // Negotiated responses remembered so that later steps with the same
  // tensors agree through one bit each. Horovod's default; 0 disables.
  int cache_capacity = 1024;

  // The stall inspector warns when some ranks have waited this long on a
  // tensor that others never submitted, and fails those ops after the
  // shutdown time when that is positive.
  bool stall_check_enabled = true;
  bool stall_check_disabled = false;  // UNISON_STALL_CHECK_DISABLE, as written; stall_check_enabled is its negation
  double stall_warning_seconds = 60.0;
  double stall_shutdown_seconds = 0.0;

  // A peer that shows no sign of life for this long is declared failed.
  // Exits are seen at once through pidfds; this bound catches a peer that is
  // alive but frozen (stopped, deadlocked).
  double peer_timeout_seconds = 10.0;

  // How long init waits for all local ranks to attach to shared memory.
  double start_timeout_seconds = 60.0;

  // Shared-memory staging area per rank. It is split into two halves so
  // one round can be filled while the previous one is still being read;
  // a collective larger than a half moves in rounds. 1 MiB halves keep a
  // round's data in cache while it is staged, reduced and gathered, even
  // where the last-level cache is shared with busy neighbours: on a 2-core
  // EPYC VM whose L3 was, 2 MiB halves ran 4-38 MiB allreduces 1.2-1.7x
  // slower at 2 ranks, 1.4x at 3 and 1.5-1.7x at 4 (with its L3 taken by
  // others, up to 8% faster at 2 ranks, still 1.4x slower at 3); on session
  // 6's VM the two were within its noise. Smaller still adds barriers,
  // which cost most when ranks outnumber cores (docs/design-notes.md).
  size_t shm_slot_bytes = 2u << 20;

  // Control messages (requests, responses) per rank per cycle.
  size_t control_message_bytes = 1u << 20;

  // Reductions of at most this many bytes are done whole by every rank (one
  // barrier) instead of split across ranks (two barriers): below it the
  // saved barrier is worth more than the duplicated arithmetic.
  size_t small_allreduce_bytes = 64u << 10;

  // A waiting thread spins this long before it sleeps in the kernel. Short,
  // so that a rank waiting for a slow peer gives its core back.
  double spin_microseconds = 50.0;
  // The spin of an idle engine thread before it sleeps; negative means
  // spin_microseconds. Not a user setting: a backend that must poll
  // something else while idle (MPI across hosts) does its own spinning.
  double idle_spin_microseconds = -1.0;
  // Whether those spins yield the core at every look (futex.h, spin_step).
  // UNISON_SPIN_YIELD: auto (the default) yields where the ranks on this
  // host outnumber the cores this process may run on, as `unisonrun -np 3`
  // on two cores does; a flag forces it either way.
  bool spin_yields_core = false;
  int spin_yield = -1;  // UNISON_SPIN_YIELD as written: -1 auto, else 0 or 1

  // UNISON_OVERLAP: whether an async op starts at once, on the engine's
  // thread, overlapping the caller's compute (1), or waits for a caller to
  // wait for it and runs on that caller's thread (0). Overlap needs a core
  // for the engine's thread: with none to spare, that thread only takes
  // time from the ranks' own compute, and the hand-offs cost more. -1
  // (auto, the default) overlaps where this host's ranks leave a core free
  // (engine_driver.cc).
  int overlap = -1;

  // UNISON_GPU_DATA_PLANE: how GPU tensors move. "auto" (the default) uses
  // NCCL where every rank of a process set has its own GPU and NCCL loads,
  // and otherwise stages through pinned host memory and the CPU backend;
  // "nccl" makes a set that cannot use NCCL an error instead of slower;
  // "staging" never uses NCCL (for comparing the two, or around an NCCL bug).
  std::string gpu_data_plane = "auto";
  LogLevel log_level = LogLevel::warning;  // UNISON_LOG_LEVEL (log.h)

  // UNISON_THREAD_AFFINITY (Horovod's HOROVOD_THREAD_AFFINITY): one core per
  // local rank, comma-separated; local rank r pins its engine thread to the
  // r-th. Empty: the thread runs wherever the process may. Read here, and
  // checked against the host's ranks once the backend knows them
  // (choose_engine_core): under mpirun the local rank comes from MPI.
  std::vector<int> thread_affinity;
  std::string thread_affinity_setting;  // "NAME='value'", as the user wrote it, for errors
  // The core this rank's engine thread is pinned to, or -1.
  int engine_core = -1;
  // UNISON_AUTOTUNE: rank 0 searches the four settings below (autotune.h),
  // except those the user set, which are *_fixed.
  bool autotune = false;
  std::string autotune_log;
  int autotune_warmup_samples = 1;
  int autotune_samples = 2;
  int autotune_steps_per_sample = 5;
  bool autotune_cache = true;  // UNISON_AUTOTUNE_CACHE=0: leave the cache out of the search (autotune.h)
  bool fusion_threshold_fixed = false, cycle_time_fixed = false, cache_fixed = false, hierarchical_fixed = false;
  // UNISON_TIMELINE: rank 0 writes a Chrome trace here from init on (timeline.h).
  std::string timeline_path;
  bool timeline_mark_cycles = false;
  // Read by a framework adapter, not by the core (torch_adapter/fast_path.py,
  // common/adapter_extension.py): they are rows of the one table so that
  // unisonrun checks them before any rank starts and the settings page
  // lists them with the rest.
  int tf_kernels = -1;       // UNISON_TF_KERNELS: -1 auto, 0 py_function nodes, 1 the compiled kernels or an error
  int torch_fast_path = -1;  // UNISON_TORCH_FAST_PATH: -1 auto, 0 the Python path, 1 the compiled one or an error
  std::string cache_dir;     // UNISON_CACHE_DIR: where compiled adapter extensions are kept

  // Every value is either understood or rejected with an error naming the
  // variable and its value; nothing set is silently ignored.
  static Status from_environment(Config* out);
  // The same, from variables given by name (nullptr: not set). The launcher
  // checks what it is about to give its ranks this way, through the very
  // parser their init() will run (unison_check_settings).
  static Status from_variables(const Variables& variables, Config* out);

  // Sets engine_core from thread_affinity for this local rank, or says why
  // it cannot: too few cores for the host's ranks, or one this process may
  // not run on.
  Status choose_engine_core();
};

// The CPUs this process may run on (its affinity mask).
int usable_cores();

// The table every setting is read through (config.cc): its names, kind,
// accepted range and meaning, which unison_setting_at() hands to Python for
// the launcher's checks and the docs' settings page.
struct SettingInfo {
  const char* name;
  const char* horovod_name;  // nullptr where Horovod has no such knob
  const char* kind;          // integer, bytes, number, flag, auto-or-flag, choice, text, path, secret, core-list
  double minimum, maximum;   // integer, bytes, number: the range accepted; secret: the least length in bytes
  const char* choices;       // choice: the words accepted, separated by '|'
  std::string default_value;
  const char* description;
  const char* flag;        // unisonrun's option, or nullptr
  const char* flag_unit;   // the unit the option takes, where not the variable's (MiB), or nullptr
  const char* config_key;  // horovodrun's config-file key (section.key), or nullptr
};
const std::vector<SettingInfo>& setting_table();

}  // namespace unison
