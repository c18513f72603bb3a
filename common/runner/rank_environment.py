"""The environment a rank gets from the launcher: its identity under
Horovod's names too, and on another host the launcher's environment.

horovodrun tells each rank who it is in HOROVOD_RANK, HOROVOD_SIZE,
HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE
and HOROVOD_HOSTNAME, and Horovod scripts read them before init() or
without it: HOROVOD_LOCAL_RANK to choose a GPU before TensorFlow starts, a
rank to name a log file. unisonrun sets unison's names (UNISON_RANK...),
and Horovod's to the same values (with_horovods_names); read without them,
such a script would quietly put every rank on GPU 0.

horovodrun gives every rank, on every host, the launcher's whole
environment, and Horovod scripts count on it: `NCCL_SOCKET_IFNAME=eth1
horovodrun -H a:4,b:4 ...` sets NCCL's interface on both hosts, and so do a
script's own settings (a data directory, a run name, an API token). A rank
on this machine inherits the launcher's environment anyway; one started
over ssh gets the login environment of the remote host, and one started by
Open MPI's mpirun on another host gets only what `-x` names. So unisonrun
sends them the launcher's environment too, all of it but the variables
that describe the launcher's own shell, session, host, login or place in
another job: those hold something else on every host, and copied they
would mislead (an ssh agent's socket that is not there, this machine's
GPUs, another account's home).

Over ssh the variables travel on the rank's standard input, with the
job's secret, not on its command line: `ps` on the remote host shows every
user a command line, and a script's settings often hold tokens. Only what
the remote wrapper needs before it can read them is on the command line
(BEFORE_THE_WRAPPER), with unison's own settings, which say what the rank
is and are useful to see in `ps`.
"""

# What a remote rank's wrapper needs to start (its Python, and the path to
# unison), and the defaults the launcher sets for every rank.
BEFORE_THE_WRAPPER = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")

# Variables that are the launcher's own, by name:
#   - the shell's bookkeeping: PWD, OLDPWD, SHLVL, _ (and exported shell
#     functions, BASH_FUNC_*, whose names no `env` or `-x` accepts);
#   - this host: HOSTNAME, and CUDA_VISIBLE_DEVICES (each host's GPUs are
#     its own; Horovod keeps it back too);
#   - the login the remote host gives, which may be another account
#     (ssh's user@host, or a different home): HOME, USER, LOGNAME, SHELL, MAIL;
#   - the launcher's place in a job of another launcher (unisonrun run by
#     srun or mpirun): every rank would claim to be that one process.
_OWN_NAMES = frozenset([
    "PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "CUDA_VISIBLE_DEVICES", "HOME", "USER", "LOGNAME", "SHELL", "MAIL",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID",
    "SLURMD_NODENAME",
])
# ...and by prefix: exported shell functions; this machine's ssh session
# (SSH_AUTH_SOCK is a socket path here, SSH_CONNECTION this connection);
# Open MPI's and Hydra's per-process identity.
_OWN_PREFIXES = ("BASH_FUNC_", "SSH_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_")


def is_the_launchers_own(name):
    """Whether the variable `name` describes the launcher's own shell,
    session, host, login or place in another job (see the module)."""
    return name in _OWN_NAMES or name.startswith(_OWN_PREFIXES)


def forwarded(env):
    """The variables of `env` that every rank on every host gets."""
    return {name: value for name, value in env.items() if not is_the_launchers_own(name)}


# unison's name for each part of a rank's identity, and horovodrun's.
HOROVODS_NAMES = {"UNISON_RANK": "HOROVOD_RANK", "UNISON_SIZE": "HOROVOD_SIZE",
                  "UNISON_LOCAL_RANK": "HOROVOD_LOCAL_RANK", "UNISON_LOCAL_SIZE": "HOROVOD_LOCAL_SIZE",
                  "UNISON_CROSS_RANK": "HOROVOD_CROSS_RANK", "UNISON_CROSS_SIZE": "HOROVOD_CROSS_SIZE",
                  "UNISON_HOSTNAME": "HOROVOD_HOSTNAME"}


def with_horovods_names(identity):
    """`identity` (UNISON_RANK and the rest), and each of its parts under
    horovodrun's name as well."""
    both = dict(identity)
    both.update({horovods: identity[ours] for ours, horovods in HOROVODS_NAMES.items() if ours in identity})
    return both


def placed_identities(hosts_by_rank):
    """Each rank's identity in a job whose rank r runs on the host named
    hosts_by_rank[r]: its local rank and size among the ranks of its host
    (in rank order), and its cross rank and size among the hosts that have
    a rank of that local rank (in order of each host's first rank), which
    is what horovodrun gives a rank. Under Horovod's names too. Hosts may
    hold different numbers of ranks."""
    names = list(dict.fromkeys(hosts_by_rank))
    ranks_on = {h: [r for r, p in enumerate(hosts_by_rank) if p == h] for h in names}
    identities = []
    for rank, host in enumerate(hosts_by_rank):
        local_rank = ranks_on[host].index(rank)
        holders = [h for h in names if len(ranks_on[h]) > local_rank]
        identities.append(with_horovods_names({
            "UNISON_RANK": str(rank), "UNISON_SIZE": str(len(hosts_by_rank)),
            "UNISON_LOCAL_RANK": str(local_rank), "UNISON_LOCAL_SIZE": str(len(ranks_on[host])),
            "UNISON_CROSS_RANK": str(holders.index(host)), "UNISON_CROSS_SIZE": str(len(holders)),
            "UNISON_HOSTNAME": host,
        }))
    return identities
