"""unisonrun: start N ranks of a command on this host, or across hosts.

    unisonrun -np 4 python train.py
    python -m unison.run -np 4 python train.py
    unisonrun -np 8 -H host1:4,host2:4 python train.py   (over ssh and TCP: tcp_run.py)
    unisonrun --mpi -np 8 -H host1:4,host2:4 python train.py   (through mpirun: mpi_run.py)

Each rank gets its identity and the job's settings through UNISON_*
environment variables. Output lines are prefixed with the rank. Ctrl-C and
SIGTERM are forwarded to every rank. When a rank fails, the others get a
short grace period to report the failure themselves (their pending
collectives fail with an error naming the dead rank), then are stopped; the
launcher exits non-zero naming the rank and its exit status.
"""
import argparse
import copyreg
import ctypes
import glob
import importlib.util
import ipaddress
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import types

from unison import rank_environment

PR_SET_PDEATHSIG = 1


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="unisonrun", description="Run a command as N unison ranks, on this host or across hosts.",
        usage="unisonrun -np N [options] command [args...]")
    p.add_argument("-v", "--version", action="version", version="unisonrun (unison) " + _version())
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks")
    p.add_argument("--fusion-threshold-mb", type=float,
                   help="pack ready allreduces into one collective up to this size (default 64)")
    p.add_argument("--cycle-time-ms", type=float,
                   help="minimum time between negotiation cycles; 0 (default) starts one as soon as work arrives")
    p.add_argument("--cache-capacity", type=int, help="response cache entries (default 1024, 0 disables)")
    p.add_argument("--stall-check-warning-time-seconds", type=float,
                   help="warn about tensors some ranks have waited on this long (default 60)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float,
                   help="fail such tensors after this long (default: never)")
    stall_check = p.add_mutually_exclusive_group()
    stall_check.add_argument("--no-stall-check", action="store_true", default=None, help="disable the stall inspector")
    stall_check.add_argument("--stall-check", dest="no_stall_check", action="store_false", default=None,
                             help="horovodrun's: the stall inspector on (the default; over a --config-file that turns "
                                  "it off)")
    p.add_argument("--peer-timeout-seconds", type=float,
                   help="declare a silent (frozen) rank failed after this long (default 10)")
    start_timeout = p.add_mutually_exclusive_group()
    start_timeout.add_argument("--start-timeout", type=float,
                               help="seconds the ranks may take to start and meet (default 60)")
    start_timeout.add_argument("--gloo-timeout-seconds", type=float,
                               help="horovodrun's name for --start-timeout here: what Gloo's timeout bounds in "
                                    "Horovod, the ranks meeting, is what --start-timeout bounds; a peer that stops "
                                    "answering later is --peer-timeout-seconds' and the stall check's to find")
    p.add_argument("--failure-grace-seconds", type=float, default=3.0,
                   help="after a rank fails, how long the others may take to exit on their own (default 3)")
    p.add_argument("--timeline-filename",
                   help="rank 0 writes a Chrome trace of every tensor's phases here (python -m unison.timeline "
                        "summarises it)")
    mark_cycles = p.add_mutually_exclusive_group()
    mark_cycles.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                             help="mark each negotiation cycle on the timeline")
    mark_cycles.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false", default=None,
                             help="horovodrun's: no cycle marks (the default; over a --config-file's)")
    autotune = p.add_mutually_exclusive_group()
    autotune.add_argument("--no-autotune", dest="autotune", action="store_false", default=None,
                          help="horovodrun's: no autotuning (the default; over a --config-file's)")
    autotune.add_argument("--autotune", action="store_true", default=None,
                   help="tune the fusion threshold, the cycle time, the response cache and, across hosts, "
                        "hierarchical allreduce during the first steps (not those set by an option or variable; "
                        "UNISON_AUTOTUNE_CACHE=0 leaves the cache out)")
    p.add_argument("--autotune-log-file", help="with --autotune: each setting tried and its score, as CSV")
    p.add_argument("--autotune-warmup-samples", type=int,
                   help="with --autotune: samples thrown away after each change (default 1)")
    p.add_argument("--autotune-steps-per-sample", type=int,
                   help="with --autotune: training steps in each sample (default 5)")
    p.add_argument("--autotune-bayes-opt-max-samples", type=int,
                   help="horovodrun's; no effect: unison's autotuner sweeps each setting in turn, without "
                        "Bayesian optimisation (native/autotune.h says why)")
    p.add_argument("--autotune-gaussian-process-noise", type=float,
                   help="horovodrun's; no effect, as --autotune-bayes-opt-max-samples")
    p.add_argument("--config-file",
                   help="horovodrun's settings file (YAML, which needs PyYAML, or JSON); options given here win "
                        "(common/run_config.py)")
    p.add_argument("--output-filename",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--verbose", action="store_true", help="print what the launcher does")
    p.add_argument("--log-level", type=str.lower, choices=["trace", "debug", "info", "warning", "error", "fatal"],
                   help="the core's messages on stderr: warning (default) prints its warnings, error silences "
                        "them, fatal its errors too (UNISON_LOG_LEVEL; the core has no info or debug messages)")
    timestamps = p.add_mutually_exclusive_group()
    timestamps.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                            action="store_true", default=None,
                            help="horovodrun's; no effect: the core's few messages carry no timestamp (to "
                                 "timestamp every line of the ranks' output: --prefix-output-with-timestamp)")
    timestamps.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                            action="store_false", default=None, help="horovodrun's; no effect, as --log-with-timestamp")
    p.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                   action="store_true",
                   help="begin each line of the ranks' output with the time the launcher read it "
                        "(2026-11-28 05:27:27.123456), before its [rank]<stdout>: prefix")
    mpi_threads = p.add_mutually_exclusive_group()
    mpi_threads.add_argument("--mpi-threads-disable", action="store_true", default=None,
                             help="horovodrun's; no effect: unison's engine thread calls MPI, so it needs at least "
                                  "MPI_THREAD_SERIALIZED and asks for MPI_THREAD_MULTIPLE (native/mpi/world.cc)")
    mpi_threads.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable", action="store_false", default=None,
                             help="horovodrun's; no effect, as --mpi-threads-disable")
    p.add_argument("--thread-affinity", metavar="CORES",
                   help="pin each rank's engine thread to a core: a comma-separated list with one core for each "
                        "rank on a host, local rank r taking the r-th (UNISON_THREAD_AFFINITY; Horovod's "
                        "HOROVOD_THREAD_AFFINITY). The ranks' own threads are left where they are")
    p.add_argument("--num-nccl-streams", type=int,
                   help="horovodrun's; no effect: unison runs NCCL on one stream per device")
    p.add_argument("--tcp", dest="tcp_flag", action="store_true",
                   help="horovodrun's: TCP only; unisonrun's data planes across hosts are TCP already unless "
                        "--mpi is given")
    p.add_argument("--disable-cache", action="store_true",
                   help="horovodrun's: it caches its start-up checks; unisonrun runs them every time, so this "
                        "changes nothing (to turn off the response cache: --cache-capacity 0)")
    cluster = p.add_argument_group("across hosts")
    cluster.add_argument("-H", "--hosts", help="hosts and their slots, e.g. host1:4,host2:4")
    cluster.add_argument("-hostfile", "--hostfile", help="a file of `host slots=N` (or `host:N`) lines")
    cluster.add_argument("--network-interface", "--network-interfaces", dest="network_interfaces",
                         action="append", metavar="INTERFACE",
                         help="the interface (such as eth0) or IPv4 address ranks listen on for each other; "
                              "default: the one that reaches the first host. 0.0.0.0 listens on every interface. "
                              "An interface is NCCL's too (NCCL_SOCKET_IFNAME), unless that is set, as with "
                              "horovodrun. horovodrun's list form is accepted when it names one interface")
    cluster.add_argument("-p", "--ssh-port", type=int, help="the port of sshd on the hosts")
    cluster.add_argument("-i", "--ssh-identity-file", help="the key ssh logs in with")
    cluster.add_argument("--rendezvous-port", type=int,
                         help="the port rank 0 listens on for the others to meet (default: a free one)")
    controller = cluster.add_mutually_exclusive_group()
    controller.add_argument("--mpi", action="store_true",
                            help="start the ranks through mpirun (MPI across hosts), even on this host alone")
    controller.add_argument("--jsrun", action="store_true",
                            help="horovodrun's; refused: unisonrun does not start ranks through LSF's jsrun")
    controller.add_argument("--gloo", action="store_true",
                            help="horovodrun's name for running without MPI: shared memory within a host and TCP "
                                 "across hosts, started over ssh; unisonrun's default")
    cluster.add_argument("--simulate-hosts", type=int, metavar="K",
                         help="through mpirun, split the ranks of this machine into K hosts (each rank is told "
                              "its host in UNISON_HOSTNAME): the cross-host paths on one machine, for testing")
    cluster.add_argument("--mpi-args", help="more arguments for mpirun, in one string")
    cluster.add_argument("--binding-args",
                         help="with --mpi: how mpirun binds and maps the ranks, in one string, in place of "
                              "unisonrun's default (Open MPI: --bind-to none --map-by slot; MPICH: none)")
    hierarchy = cluster.add_mutually_exclusive_group()
    hierarchy.add_argument("--hierarchical-allreduce", dest="hierarchical", action="store_true", default=None,
                           help="shared memory within each host, MPI across hosts (the default)")
    hierarchy.add_argument("--no-hierarchical-allreduce", dest="hierarchical", action="store_false",
                           help="every byte between ranks over MPI (flat)")
    gather_hierarchy = cluster.add_mutually_exclusive_group()
    gather_hierarchy.add_argument("--hierarchical-allgather", dest="hierarchical_allgather", action="store_true",
                                  default=None,
                                  help="horovodrun's; allgather follows the allreduce's layout "
                                       "(--hierarchical-allreduce), which is hierarchical by default")
    gather_hierarchy.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                                  action="store_false", help="as --hierarchical-allgather")
    elastic = p.add_argument_group("elastic (elastic_run.py): the job goes on when workers fail, and grows")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="the fewest workers the job trains with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="the most workers the job grows to (default: -np)")
    elastic.add_argument("--host-discovery-script",
                         help="a command printing the usable hosts, one `host:slots` (or `host`) per line; "
                              "re-run every second")
    elastic.add_argument("--slots", "--slots-per-host", dest="slots", type=int,
                         help="slots of a host the discovery script prints without any")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="how long the job waits for --min-np slots, or for a new worker to start "
                              "(default 600 s)")
    elastic.add_argument("--reset-limit", type=int,
                         help="end the job when it would re-form more than this many times (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LOW", "HIGH"),
                         help="a failed host returns after LOW seconds, twice as long each later time, at most "
                              "HIGH (default: never)")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks and data planes this install supports, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = p.parse_args(argv)
    if args.check_build:
        return args
    # Kept apart until now, so that an error names the option that was given.
    given_start_timeout = "--start-timeout"
    if args.gloo_timeout_seconds is not None:
        args.start_timeout, given_start_timeout = args.gloo_timeout_seconds, "--gloo-timeout-seconds"
    # Times and counts that no negative, infinite or NaN value makes sense for.
    # Most are the core's settings, whose variables init() would refuse in
    # every rank, naming the variable rather than the option; a NaN grace
    # period would never end.
    for flag, value in (("--failure-grace-seconds", args.failure_grace_seconds),
                        ("--fusion-threshold-mb", args.fusion_threshold_mb), ("--cycle-time-ms", args.cycle_time_ms),
                        ("--cache-capacity", args.cache_capacity),
                        ("--stall-check-warning-time-seconds", args.stall_check_warning_time_seconds),
                        ("--stall-check-shutdown-time-seconds", args.stall_check_shutdown_time_seconds),
                        ("--peer-timeout-seconds", args.peer_timeout_seconds),
                        (given_start_timeout, args.start_timeout)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            p.error("%s %g: a number of at least 0" % (flag, value))
    if args.command[:1] == ["--"]:  # `unisonrun -np 2 -- python train.py`: the end of the options, as anywhere
        args.command = args.command[1:]
    args.network_interface = _one_interface(p, args.network_interfaces)
    if args.jsrun:
        p.error("--jsrun: unisonrun does not start ranks through LSF's jsrun; use --mpi (LSF's mpirun) or -H/--hostfile "
                "with the job's hosts")
    if args.thread_affinity is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", args.thread_affinity):
        p.error("--thread-affinity %s: give core numbers separated by commas, one for each rank on a host (0,1,2,3)"
                % args.thread_affinity)
    # On the command line only: a file may keep an autotune section switched off.
    if args.autotune_log_file and not args.autotune:
        p.error("--autotune-log-file %s needs --autotune" % args.autotune_log_file)
    if args.config_file:
        from unison import run_config
        # What parsing nothing gives (get_default would say True for a dest
        # that a store_false shares with a store_true).
        defaults = vars(p.parse_args([]))
        given = {dest for dest, value in vars(args).items() if value != defaults.get(dest)}
        try:
            run_config.apply(args, args.config_file, given)
        except ValueError as e:
            p.error("--config-file %s: %s" % (args.config_file, e))
    if args.np is None or args.np < 1:
        p.error("-np N (at least 1) is required")
    if not args.command:
        p.error("a command to run is required")
    for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np), ("--slots", args.slots),
                        ("--autotune-steps-per-sample", args.autotune_steps_per_sample)):
        if value is not None and value < 1:
            p.error("%s %d: at least 1" % (flag, value))
    if args.output_filename:  # made now, so that a folder that cannot be is refused before any rank starts
        try:
            os.makedirs(args.output_filename, exist_ok=True)
        except OSError as e:
            p.error("--output-filename %s: cannot make the folder: %s" % (args.output_filename, e.strerror))
    if args.simulate_hosts is not None and args.simulate_hosts < 1:
        p.error("--simulate-hosts %d: at least 1" % args.simulate_hosts)
    for flag, value in (("--ssh-port", args.ssh_port), ("--rendezvous-port", args.rendezvous_port)):
        if value is not None and not 1 <= value <= 65535:
            p.error("%s %d: a TCP port, 1 to 65535" % (flag, value))
    if args.autotune_warmup_samples is not None and args.autotune_warmup_samples < 0:
        p.error("--autotune-warmup-samples %d: at least 0" % args.autotune_warmup_samples)
    if args.min_np is not None and args.max_np is not None and args.min_np > args.max_np:
        p.error("--min-np %d is more than --max-np %d" % (args.min_np, args.max_np))
    if args.reset_limit is not None and args.reset_limit < 0:
        p.error("--reset-limit %d: at least 0" % args.reset_limit)
    if args.elastic_timeout is not None and args.elastic_timeout <= 0:
        p.error("--elastic-timeout %g: more than 0" % args.elastic_timeout)
    only_elastic = [flag for flag, value in (("--slots", args.slots), ("--elastic-timeout", args.elastic_timeout),
                                             ("--reset-limit", args.reset_limit),
                                             ("--blacklist-cooldown-range", args.blacklist_cooldown_range))
                    if value is not None]
    if only_elastic and not _elastic(args):
        p.error("%s only apply to an elastic job: add --min-np, --max-np or --host-discovery-script"
                % ", ".join(only_elastic))
    if args.elastic_timeout is None:
        args.elastic_timeout = 600.0
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        p.error("--blacklist-cooldown-range %g %g: 0 <= LOW <= HIGH" % tuple(cooldown))
    if args.binding_args and not _through_mpirun(args):
        p.error("--binding-args %s: binding is mpirun's, and this job does not start through mpirun: add --mpi"
                % args.binding_args)
    if _elastic(args) and _through_mpirun(args):
        p.error("an elastic job (--min-np, --max-np, --host-discovery-script) runs over TCP, not --mpi")
    if args.gloo and args.simulate_hosts:
        p.error("--gloo runs without MPI, and --simulate-hosts goes through mpirun: give one")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        p.error("--host-discovery-script and -H/--hostfile both name the hosts: give one")
    refused = what_init_would_refuse(args)
    if refused:
        p.error(refused)
    return args


def what_init_would_refuse(args):
    """The first setting in the environment the ranks are about to get
    (this one's, with the options' variables over it) that their init() would
    refuse, said as init() says it; or None. The core's own parser reads it
    (unison_check_settings), so that a bad HOROVOD_CYCLE_TIME, say, stops
    the job here, once, instead of failing every rank's init() after they
    have started."""
    from unison import basics
    # A rank's identity comes from the launcher, never from the variables of
    # an mpirun or srun around this one.
    env = dict(os.environ, **_settings(args), UNISON_RANK="0", UNISON_SIZE=str(args.np))
    problem = basics.settings_problem(env)
    return problem and re.sub(r"^unison: ", "", problem)


def check_build():
    from unison import basics

    def mark(present):
        return "[X]" if present else "[ ]"

    frameworks = [("NumPy", "numpy"), ("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("MXNet", "mxnet")]
    built = basics.built_backends()
    lines = ["unison v%s:" % __import__("unison").__version__, "", "Available Frameworks:"]
    for label, module in frameworks:
        lines.append("    %s %s" % (mark(importlib.util.find_spec(module) is not None), label))
    lines += ["", "Available Data Planes:",
              "    %s Shared memory (one host)" % mark("shm" in built),
              "    %s TCP (several hosts, no MPI)" % mark("tcp" in built),
              "    %s MPI (several hosts)" % mark("mpi" in built),
              "    %s NCCL (GPUs)" % mark(basics.nccl_built()),
              "    %s Host staging (GPUs without NCCL)" % mark(basics.cuda_built()),
              "", "GPU support (found at run time): " + basics.device_support()]
    print("\n".join(lines))
    return 0


def _settings(args):
    """UNISON_* variables for the options that were given."""
    env = {}
    if args.fusion_threshold_mb is not None:
        env["UNISON_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["UNISON_CYCLE_TIME"] = str(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env["UNISON_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.stall_check_warning_time_seconds is not None:
        env["UNISON_STALL_CHECK_TIME_SECONDS"] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["UNISON_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_check_shutdown_time_seconds)
    if args.no_stall_check:
        env["UNISON_STALL_CHECK_DISABLE"] = "1"
    if args.peer_timeout_seconds is not None:
        env["UNISON_PEER_TIMEOUT_SECONDS"] = str(args.peer_timeout_seconds)
    if args.start_timeout is not None:
        env["UNISON_START_TIMEOUT"] = str(args.start_timeout)
    if args.log_level is not None:
        env["UNISON_LOG_LEVEL"] = args.log_level
    if args.autotune:
        env["UNISON_AUTOTUNE"] = "1"
        if args.autotune_log_file:
            env["UNISON_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
        if args.autotune_warmup_samples is not None:
            env["UNISON_AUTOTUNE_WARMUP_SAMPLES"] = str(args.autotune_warmup_samples)
        if args.autotune_steps_per_sample is not None:
            env["UNISON_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.autotune_steps_per_sample)
    if args.timeline_filename:
        env["UNISON_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.timeline_mark_cycles:
        env["UNISON_TIMELINE_MARK_CYCLES"] = "1"
    if args.hierarchical is not None:
        env["UNISON_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical else "0"
    if args.thread_affinity is not None:
        env["UNISON_THREAD_AFFINITY"] = args.thread_affinity.replace(" ", "")
    # As horovodrun does, NCCL's own sockets go where the ranks meet: its
    # bootstrap, and a flat communicator across hosts
    # (UNISON_HIERARCHICAL_ALLREDUCE=0), would otherwise take the first
    # interface NCCL likes, perhaps one the hosts cannot reach each other on.
    # A NCCL_SOCKET_IFNAME of the user's own wins.
    if _names_an_interface(args.network_interface) and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = args.network_interface
    return env


def _names_an_interface(given):
    """Whether --network-interface named an interface (eth0), not an
    address or every interface (0.0.0.0)."""
    if not given:
        return False
    try:
        ipaddress.ip_address(given)
        return False
    except ValueError:
        return True


def _one_interface(parser, given):
    """The one interface of --network-interface(s): horovodrun takes several
    and uses those every host has; unison's ranks listen on one address, so
    naming more is refused rather than one of them picked."""
    if not given:
        return None
    names = list(dict.fromkeys(n.strip() for item in given for n in item.split(",") if n.strip()))
    if len(names) != 1:
        parser.error("--network-interface(s) %s: the ranks listen on one interface or address; give one"
                     % ",".join(given))
    return names[0]


def _version():
    from unison import __version__
    return __version__


def _through_mpirun(args):
    return bool(args.mpi or args.simulate_hosts)


def _elastic(args):
    return bool(args.host_discovery_script or args.min_np is not None or args.max_np is not None)


def _across_hosts(args):
    return bool(args.hosts or args.hostfile)


def _die_with_parent():
    # A rank must not outlive a launcher that was killed outright.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


# How a rank's wrapper on another host says the rank failed (tcp_run.py,
# mpi_run.py): ssh's own exit status cannot tell a signal from a status.
FAILURE = re.compile(rb"unisonrun: rank (\d+) .*?((?:exited with status|was killed by signal) \d+.*)$")


def _forward(stream, rank, kind, sink, log_file, report=None, timestamped=False):
    prefix = ("[%s]<%s>:" % (rank, kind)).encode()  # a rank, or an elastic worker host:slot
    for line in iter(stream.readline, b""):
        if report is not None:
            match = FAILURE.search(line.rstrip(b"\n"))
            if match:
                report.setdefault(rank, match.group(2).decode(errors="replace"))
        if not line.endswith(b"\n"):
            line += b"\n"
        # The time the line arrived (a rank's buffered output arrives late),
        # in the files too: they are what is read afterwards.
        stamp = _timestamp() if timestamped else b""
        if log_file is not None:
            log_file.write(stamp + line)
            log_file.flush()
        sink.buffer.write(stamp + prefix + line)
        sink.buffer.flush()
    stream.close()


def _timestamp():
    now = time.time()
    return (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + ".%06d " % int(now % 1 * 1e6)).encode()


def _describe(code):
    if code < 0:
        try:
            return "was killed by signal %d (%s)" % (-code, signal.Signals(-code).name)
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with status %d" % code


def start_process(command, env, stdin_text=None):
    """A rank's process (or an elastic worker's): a session of its own, so
    that signals reach it only through the launcher, and killed with the
    launcher. stdin_text goes first on its standard input, which stays open:
    a remote wrapper ends its rank when it closes (tcp_run.py)."""
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:
        # No such program, or not one this user may run: said as a shell
        # says it, with a shell's status (127, 126), not as a traceback of
        # the launcher's. The ranks started before it end with the launcher.
        missing = isinstance(e, FileNotFoundError) and os.sep not in command[0]
        print("unisonrun: %s: %s" % (command[0], "command not found" if missing else e.strerror),
              file=sys.stderr, flush=True)
        raise SystemExit(127 if isinstance(e, FileNotFoundError) else 126) from None
    if stdin_text is not None:
        try:
            proc.stdin.write(stdin_text.encode())
            proc.stdin.flush()
        except BrokenPipeError:
            # It ended without reading it: ssh could not reach the host, or
            # the remote command could not start. That is reported as any
            # rank's end is, with its status and what it printed; a traceback
            # from here would say neither.
            pass
    return proc


def forward_output(proc, label, folder, threads, logs, report=None, mode="wb", timestamped=False):
    """Copies the process's output to ours, each line prefixed with label
    (and the time, when timestamped), and to folder/stdout and folder/stderr
    when folder is given; `report` collects a remote wrapper's account of how
    its rank ended (stderr)."""
    for stream, kind, sink in ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr)):
        log_file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            log_file = open(os.path.join(folder, kind), mode)
            logs.append(log_file)
        t = threading.Thread(target=_forward, args=(stream, label, kind, sink, log_file,
                                                    report if kind == "stderr" else None, timestamped),
                             daemon=True)
        t.start()
        threads.append(t)


class Launch:
    """How one rank starts: its command, its environment, and, for a rank on
    another host, the host (the command is then ssh) and what ssh's stdin
    carries first (the job's secret, which never goes on a command line)."""

    def __init__(self, rank, command, env, host=None, stdin_text=None):
        self.rank, self.command, self.env, self.host, self.stdin_text = rank, command, env, host, stdin_text


def local_launches(args, job_id, base):
    """Every rank on this host."""
    n = args.np
    launches = []
    for rank in range(n):
        env = dict(base)
        env.update(rank_environment.with_horovods_names({
            "UNISON_RANK": str(rank), "UNISON_SIZE": str(n),
            "UNISON_LOCAL_RANK": str(rank), "UNISON_LOCAL_SIZE": str(n),
            "UNISON_CROSS_RANK": "0", "UNISON_CROSS_SIZE": "1",
            "UNISON_JOB_ID": job_id,
        }))
        launches.append(Launch(rank, args.command, env))
    return launches


def base_environment(args):
    """What every rank's environment starts from."""
    base = dict(os.environ)
    base.update(_settings(args))
    base.setdefault("PYTHONUNBUFFERED", "1")
    # Like torchrun: one OpenMP thread per rank unless told otherwise, so
    # that N ranks do not each spawn a thread per core.
    if args.np > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    return base


# How long a rank has to end once told to (SIGTERM, or the signal that
# stopped the launcher) before it is killed; horovodrun gives 5 s as well,
# and unisonrun's remote wrappers and elastic driver do the same.
STOP_GRACE_SECONDS = 5


class Job:
    def __init__(self, args):
        self.args = args
        self.job_id = new_job_id()
        self.procs = []
        self.hosts = {}  # rank -> host, for ranks started on hosts named with -H
        self.reported = {}  # rank -> how a remote rank's wrapper said it ended
        self.threads = []
        self.logs = []
        # (rank, exit code) in the order the ranks ended, appended by one
        # waiting thread per rank. Polling all ranks in turn cannot tell which
        # of two ranks that ended between two polls ended first, and the first
        # is the one to blame: the others usually ended because it did.
        self.exits = []
        self.exited = threading.Condition()
        # When the ranks still running are killed: set once the launcher
        # is told to stop (stop()) or a rank's failure's grace period ends.
        self.kill_at = None
        self.told_to_stop = None  # the signal that told the launcher to stop

    def log(self, message):
        if self.args.verbose:
            print("unisonrun: " + message, file=sys.stderr, flush=True)

    def describe(self, rank):
        return "rank %d (host %s)" % (rank, self.hosts[rank]) if rank in self.hosts else "rank %d" % rank

    def start(self, launches):
        for launch in launches:
            rank = launch.rank
            if launch.host is not None:
                self.hosts[rank] = launch.host
            self.log("starting %s: %s" % (self.describe(rank), " ".join(launch.command)))
            proc = start_process(launch.command, launch.env, launch.stdin_text)
            self.procs.append(proc)
            waiter = threading.Thread(target=self._await_exit, args=(rank, proc), daemon=True)
            waiter.start()
            folder = os.path.join(self.args.output_filename, "rank.%d" % rank) if self.args.output_filename else None
            forward_output(proc, rank, folder, self.threads, self.logs,
                           report=self.reported if launch.host is not None else None,
                           timestamped=self.args.prefix_output_with_timestamp)

    def _await_exit(self, rank, proc):
        code = proc.wait()
        with self.exited:
            self.exits.append((rank, code))
            self.exited.notify_all()

    def signal_all(self, signum):
        with self.exited:
            ended = {rank for rank, _ in self.exits}
        for rank, proc in enumerate(self.procs):
            if rank not in ended:
                if proc.stdin is not None:
                    try:  # ssh's end: the remote wrapper stops its rank
                        proc.stdin.close()
                    except OSError:
                        pass
                signal_process_group(proc.pid, signum)

    def stop(self, signum):
        """The launcher was told to stop (Ctrl-C, SIGTERM): every rank is
        told the same, and a rank still running STOP_GRACE_SECONDS later is
        killed. A rank may ignore the signal, block it in native code, or be
        stopped (SIGSTOP, a debugger): the launcher must end anyway, as
        horovodrun's does, rather than wait on it for ever."""
        self.log("forwarding signal %d to every rank" % signum)
        self.signal_all(signum)
        if self.kill_at is None:
            self.told_to_stop = signum
            self.kill_at = time.monotonic() + STOP_GRACE_SECONDS

    def kill_the_rest(self, why):
        with self.exited:
            ended = {rank for rank, _ in self.exits}
        running = [self.describe(rank) for rank in range(len(self.procs)) if rank not in ended]
        if running:
            print("unisonrun: %s still running %s; killing %s" % (", ".join(running), why,
                                                                  "it" if len(running) == 1 else "them"),
                  file=sys.stderr, flush=True)
        self.signal_all(signal.SIGKILL)

    def wait(self):
        """Returns the launcher's exit status."""
        failed = None  # (rank, code) of the first rank that ended with an error
        deadline = None
        seen = 0
        while True:
            with self.exited:
                # Short waits, so that Ctrl-C and SIGTERM handlers run.
                self.exited.wait_for(lambda: len(self.exits) > seen, timeout=0.05)
                ended = list(self.exits)
            for rank, code in ended[seen:]:
                if code != 0 and failed is None:
                    failed = (rank, code)
                    deadline = time.monotonic() + self.args.failure_grace_seconds
                    print("unisonrun: %s %s; stopping the other ranks" % (self.describe(rank), self._how(rank, code)),
                          file=sys.stderr, flush=True)
            seen = len(ended)
            if seen == len(self.procs):
                break
            if deadline is not None and time.monotonic() > deadline:
                self.log("grace period over: terminating the remaining ranks")
                self.signal_all(signal.SIGTERM)
                deadline = None
                if self.kill_at is None:
                    self.kill_at = time.monotonic() + STOP_GRACE_SECONDS
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                self.kill_the_rest("%d s after signal %d" % (STOP_GRACE_SECONDS, self.told_to_stop)
                                   if self.told_to_stop else "%d s after SIGTERM" % STOP_GRACE_SECONDS)
                self.kill_at = None
        for t in self.threads:
            t.join(timeout=5)
        for f in self.logs:
            f.close()
        self.cleanup()
        if failed is None:
            return 0
        rank, code = failed
        how = self._how(rank, code)
        print("unisonrun: job failed: %s %s" % (self.describe(rank), how), file=sys.stderr, flush=True)
        status = re.search(r"exited with status (\d+)", how)
        signum = re.search(r"killed by signal (\d+)", how)
        return int(status.group(1)) if status else 128 + int(signum.group(1))

    def _how(self, rank, code):
        # A remote rank's own wrapper knows how it ended; ssh only passes on a status.
        for _ in range(20):  # its line may still be on the way
            if rank in self.reported or rank not in self.hosts:
                break
            time.sleep(0.05)
        return self.reported.get(rank, _describe(code))

    def cleanup(self):
        remove_shared_memory(self.job_id)


def signal_process_group(pid, signum):
    """Sends a rank's process group `signum`, and SIGCONT after it unless
    the signal kills outright: a rank stopped by SIGSTOP or SIGTSTP would
    otherwise see a SIGTERM only when something continued it, and be killed
    STOP_GRACE_SECONDS later without running its handlers. (A rank held by
    a debugger stays held: ptrace's stops ignore SIGCONT.)"""
    try:
        os.killpg(pid, signum)
        if signum != signal.SIGKILL:
            os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def new_job_id():
    """The launcher's pid (which says whose a leftover segment was) and 128
    random bits: the job's shared memory is named after it, and a name
    nobody can guess is one nobody can take first."""
    return "%d-%s" % (os.getpid(), secrets.token_hex(16))


def remove_shared_memory(job_id):
    """Ranks unlink their shared memory once all have attached; a crash
    during start-up can still leave a segment of the job behind."""
    for path in glob.glob("/dev/shm/unison-%s-*" % job_id):
        try:
            os.unlink(path)
        except OSError:
            pass


# What ties a process to the job it is a rank of. A launcher started inside
# a rank (unison.run(func) in a training script, say) starts a job of its
# own, so its ranks must not inherit these: a rendezvous address would send
# them to the outer job's rank 0, an elastic driver's to the outer driver,
# and the outer rank's record of its init() (basics.INITIALIZED_BY) would
# refuse their init(); under mpirun, an inherited UNISON_RANK (or its
# horovodrun name, which init() also reads) would override MPI's identity.
# Each launcher sets what its own ranks need of these.
JOB_WIRING = ("UNISON_RANK", "UNISON_SIZE", "UNISON_LOCAL_RANK", "UNISON_LOCAL_SIZE", "UNISON_CROSS_RANK",
              "UNISON_CROSS_SIZE", "UNISON_JOB_ID", "UNISON_RENDEZVOUS_ADDR", "UNISON_RENDEZVOUS_PORT",
              "UNISON_SECRET_KEY", "UNISON_ELASTIC_DRIVER", "UNISON_ELASTIC_WORKER", "UNISON_ELASTIC_ROUND",
              "UNISON_INITIALIZED_BY") + tuple(rank_environment.HOROVODS_NAMES.values())


def main(argv=None):
    for name in JOB_WIRING:
        os.environ.pop(name, None)
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        return check_build()
    if _through_mpirun(args):
        from unison import mpi_run
        return mpi_run.launch(args, _settings(args))
    if _elastic(args):
        from unison import elastic_run
        return elastic_run.launch(args, new_job_id(), base_environment(args))
    job = Job(args)
    if _across_hosts(args):
        from unison import tcp_run
        launches = tcp_run.launches(args, job.job_id, base_environment(args))
    else:
        launches = local_launches(args, job.job_id, base_environment(args))

    signal.signal(signal.SIGINT, lambda signum, _frame: job.stop(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: job.stop(signum))
    job.start(launches)
    return job.wait()


class _LauncherModule(types.ModuleType):
    """`unison.run` names two things, as `horovod.run` and horovodrun do:
    this launcher's module (`python -m unison.run`), and, called, the
    launcher for Python functions (`unison.run(train, num_proc=2)`,
    run_function.py). Importing a submodule sets it as an attribute of its
    package, so a function `unison.run` would be replaced by this module the
    first time anything imported it; a module that can be called is both,
    however it was reached."""

    def __call__(self, func, *args, **kwargs):
        from unison.run_function import run
        return run(func, *args, **kwargs)


def _import_by_name(module):
    # How the module pickles: by name, as a plain module does. cloudpickle
    # pickles the submodules a function may reach (`unison.elastic.run`
    # names one called "run"), and only knows plain modules.
    return importlib.import_module, (module.__name__,)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _LauncherModule
    copyreg.pickle(_LauncherModule, _import_by_name)
