"""unisonrun's command line: its options, the checks on them, and the
UNISON_* variables they set for the ranks.

The options for the core's settings are not written here: each comes from
its row of the core's settings table (native/config.cc, read through
basics.setting_table()), with its type, range, default and help, and so do
the keys of horovodrun's config file that set them (config_file.py). What
is written here is the launcher's own: how many ranks, which hosts, how
they start, and horovodrun's options that unison takes for compatibility."""
import argparse
import ipaddress
import math
import os
import re

from unison import basics
from unison.runner import config_file
from unison.runner.settings import NUMERIC, UNIT_BYTES, core_settings, dest
from unison.version import VERSION


def parse(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.check_build:
        return args
    _check(p, args)
    return args


def parser():
    """unisonrun's argument parser (the docs' table of options is made from
    it too: settings_page.launcher_options)."""
    p = argparse.ArgumentParser(
        prog="unisonrun", description="Run a command as N unison ranks, on this host or across hosts.",
        usage="unisonrun -np N [options] command [args...]")
    p.add_argument("-v", "--version", action="version", version="unisonrun (unison) " + VERSION)
    p.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N", help="number of ranks")
    _add_core_settings(p.add_argument_group(
        "the core's settings", "each sets the variable named, which a rank's init() reads (native/config.cc); "
        "an option given wins over --config-file"))
    _add_launcher_options(p)
    _add_horovodruns_options(p.add_argument_group(
        "horovodrun's options", "taken so that a horovodrun command line runs unchanged; what each does here"))
    _add_host_options(p)
    _add_elastic_options(p)
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks and data planes this install supports, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def _add_host_options(p):
    cluster = p.add_argument_group("across hosts")
    cluster.add_argument("-H", "--hosts", metavar="HOSTS", help="hosts and their slots, e.g. host1:4,host2:4")
    cluster.add_argument("-hostfile", "--hostfile", metavar="FILE", help="a file of `host slots=N` (or `host:N`) lines")
    cluster.add_argument("--network-interface", "--network-interfaces", dest="network_interfaces",
                         action="append", metavar="INTERFACE",
                         help="the interface (such as eth0) or IPv4 address ranks listen on for each other; "
                              "default: the one that reaches the first host. 0.0.0.0 listens on every interface. "
                              "An interface is NCCL's too (NCCL_SOCKET_IFNAME), unless that is set, as with "
                              "horovodrun. horovodrun's list form is accepted when it names one interface")
    cluster.add_argument("-p", "--ssh-port", type=int, help="the port of sshd on the hosts")
    cluster.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="the key ssh logs in with")
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
    cluster.add_argument("--mpi-args", metavar="ARGS", help="more arguments for mpirun, in one string")
    cluster.add_argument("--binding-args", metavar="ARGS",
                         help="with --mpi: how mpirun binds and maps the ranks, in one string, in place of "
                              "unisonrun's default (Open MPI: --bind-to none --map-by slot; MPICH: none)")
    gather_hierarchy = cluster.add_mutually_exclusive_group()
    gather_hierarchy.add_argument("--hierarchical-allgather", dest="hierarchical_allgather", action="store_true",
                                  default=None,
                                  help="horovodrun's; allgather follows the allreduce's layout "
                                       "(--hierarchical-allreduce), which is hierarchical by default")
    gather_hierarchy.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                                  action="store_false", help="as --hierarchical-allgather")


def _add_elastic_options(p):
    elastic = p.add_argument_group("elastic (elastic_driver.py): the job goes on when workers fail, and grows")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="the fewest workers the job trains with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="the most workers the job grows to (default: -np)")
    elastic.add_argument("--host-discovery-script", metavar="COMMAND",
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


def _add_core_settings(group):
    for row in core_settings():
        about = [row["name"]] + (["Horovod's " + row["horovod_name"]] if row["horovod_name"] else [])
        if row["kind"] == "flag":
            _add_flag(group, row, "; ".join(about))
            continue
        default = row["default"]
        if row["flag_unit"] and default:
            default = "%g" % (float(default) / UNIT_BYTES[row["flag_unit"]])
        about.append("default " + (default or "none") + (" " + row["flag_unit"] if row["flag_unit"] else ""))
        if row["flag_unit"]:
            about.insert(0, "given in " + row["flag_unit"])
        options = {"metavar": "CORES" if row["kind"] == "core-list" else None}
        if row["kind"] == "integer":
            options["type"] = int
        elif row["kind"] in NUMERIC:
            options["type"] = float
        elif row["kind"] == "choice":
            options.update(type=str.lower, choices=row["choices"], metavar=None)
        group.add_argument(row["flag"], dest=dest(row), help=_help(row, "; ".join(about)), **options)


def _add_flag(group, row, about):
    """A flag's pair of options, --X and --no-X: the table's option sets the
    variable to 1, the other clears it (settings() says when that sets the
    variable to 0)."""
    pair = group.add_mutually_exclusive_group()
    other = "--" + row["flag"][5:] if row["flag"].startswith("--no-") else "--no-" + row["flag"][2:]
    default_on = row["default"] == "1"
    pair.add_argument(row["flag"], dest=dest(row), action="store_true", default=None,
                      help=_help(row, about + "; %s by default" % ("on" if default_on else "off")))
    pair.add_argument(other, dest=dest(row), action="store_false", default=None,
                      help="the opposite of %s, over a --config-file that sets it" % row["flag"])


def _help(row, about):
    text = row["description"].rstrip(".")
    text = text[0].lower() + text[1:]
    return ("%s (%s)" % (text, about)).replace("%", "%%")


def _add_launcher_options(p):
    p.add_argument("--failure-grace-seconds", type=float, default=3.0,
                   help="after a rank fails, how long the others may take to exit on their own (default 3)")
    p.add_argument("--config-file", metavar="FILE",
                   help="horovodrun's settings file (YAML, which needs PyYAML, or JSON); options given here win "
                        "(common/runner/config_file.py)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--verbose", action="store_true", help="print what the launcher does")
    p.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                   action="store_true",
                   help="begin each line of the ranks' output with the time the launcher read it "
                        "(2026-11-28 05:27:27.123456), before its [rank]<stdout>: prefix")


def _add_horovodruns_options(group):
    group.add_argument("--gloo-timeout-seconds", type=float,
                       help="--start-timeout: what Gloo's timeout bounds in Horovod, the ranks meeting, is what "
                            "--start-timeout bounds; a peer that stops answering later is --peer-timeout-seconds' "
                            "and the stall check's to find")
    group.add_argument("--autotune-bayes-opt-max-samples", type=int,
                       help="no effect: unison's autotuner sweeps each setting in turn, without Bayesian "
                            "optimisation (native/autotune.h says why)")
    group.add_argument("--autotune-gaussian-process-noise", type=float,
                       help="no effect, as --autotune-bayes-opt-max-samples")
    timestamps = group.add_mutually_exclusive_group()
    timestamps.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                            action="store_true", default=None,
                            help="no effect: the core's few messages carry no timestamp (to timestamp every line "
                                 "of the ranks' output: --prefix-output-with-timestamp)")
    timestamps.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                            action="store_false", default=None, help="no effect, as --log-with-timestamp")
    mpi_threads = group.add_mutually_exclusive_group()
    mpi_threads.add_argument("--mpi-threads-disable", action="store_true", default=None,
                             help="no effect: unison's engine thread calls MPI, so it needs at least "
                                  "MPI_THREAD_SERIALIZED and asks for MPI_THREAD_MULTIPLE (native/mpi/world.cc)")
    mpi_threads.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable", action="store_false",
                             default=None, help="no effect, as --mpi-threads-disable")
    group.add_argument("--num-nccl-streams", type=int, help="no effect: unison runs NCCL on one stream per device")
    group.add_argument("--tcp", dest="tcp_flag", action="store_true",
                       help="TCP only; unisonrun's data planes across hosts are TCP already unless --mpi is given")
    group.add_argument("--disable-cache", action="store_true",
                       help="horovodrun caches its start-up checks; unisonrun runs them every time, so this "
                            "changes nothing (to turn off the response cache: --cache-capacity 0)")


def _check(p, args):
    # Kept apart until now, so that an error names the option that was given.
    given_as = {}
    if args.gloo_timeout_seconds is not None:
        if args.start_timeout is not None:
            p.error("argument --gloo-timeout-seconds: not allowed with argument --start-timeout")
        args.start_timeout, given_as["--start-timeout"] = args.gloo_timeout_seconds, "--gloo-timeout-seconds"
    # Times and counts that no negative, infinite or NaN value makes sense
    # for. The core's settings would be refused by every rank's init() too,
    # naming the variable rather than the option (what_init_would_refuse
    # checks their ranges here, once); a NaN grace period would never end.
    numbers = [("--failure-grace-seconds", args.failure_grace_seconds)] + [
        (given_as.get(row["flag"], row["flag"]), getattr(args, dest(row)))
        for row in core_settings() if row["kind"] in NUMERIC]
    for flag, value in numbers:
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
        # What parsing nothing gives (get_default would say True for a dest
        # that a store_false shares with a store_true).
        defaults = vars(p.parse_args([]))
        given = {dest for dest, value in vars(args).items() if value != defaults.get(dest)}
        try:
            config_file.apply(args, args.config_file, given)
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
    if only_elastic and not is_elastic(args):
        p.error("%s only apply to an elastic job: add --min-np, --max-np or --host-discovery-script"
                % ", ".join(only_elastic))
    if args.elastic_timeout is None:
        args.elastic_timeout = 600.0
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        p.error("--blacklist-cooldown-range %g %g: 0 <= LOW <= HIGH" % tuple(cooldown))
    if args.binding_args and not through_mpirun(args):
        p.error("--binding-args %s: binding is mpirun's, and this job does not start through mpirun: add --mpi"
                % args.binding_args)
    if is_elastic(args) and through_mpirun(args):
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
    # A rank's identity comes from the launcher, never from the variables of
    # an mpirun or srun around this one.
    env = dict(os.environ, **settings(args), UNISON_RANK="0", UNISON_SIZE=str(args.np))
    problem = basics.settings_problem(env)
    return problem and re.sub(r"^unison: ", "", problem)


def settings(args):
    """UNISON_* variables for the options that were given (or that
    --config-file set). A flag's negation, given where the core's default
    is already off, sets nothing, as horovodrun's does; the autotuner's own
    options count only with --autotune."""
    env = {}
    for row in core_settings():
        value = getattr(args, dest(row))
        if value in (None, "") or (row["flag"].startswith("--autotune-") and not args.autotune):
            continue
        if row["kind"] == "flag":
            if value or row["default"] == "1":
                env[row["name"]] = "1" if value else "0"
        elif row["flag_unit"]:
            env[row["name"]] = str(int(value * UNIT_BYTES[row["flag_unit"]]))
        elif row["kind"] == "path":  # the ranks may start in another folder, or on another host
            env[row["name"]] = os.path.abspath(value)
        elif row["kind"] == "core-list":
            env[row["name"]] = value.replace(" ", "")
        else:
            env[row["name"]] = str(value)
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


def through_mpirun(args):
    return bool(args.mpi or args.simulate_hosts)


def is_elastic(args):
    return bool(args.host_discovery_script or args.min_np is not None or args.max_np is not None)


def across_hosts(args):
    return bool(args.hosts or args.hostfile)


def base_environment(args):
    """What every rank's environment starts from."""
    base = dict(os.environ)
    base.update(settings(args))
    base.setdefault("PYTHONUNBUFFERED", "1")
    # Like torchrun: one OpenMP thread per rank unless told otherwise, so
    # that N ranks do not each spawn a thread per core.
    if args.np > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    return base


# How long a rank has to end once told to (SIGTERM, or the signal that
