"""unisonrun: start N ranks of a command on this host, or across hosts.

    unisonrun -np 4 python train.py
    python -m unison.run -np 4 python train.py
    unisonrun -np 8 -H host1:4,host2:4 python train.py   (over ssh and TCP: ssh.py)
    unisonrun --mpi -np 8 -H host1:4,host2:4 python train.py   (through mpirun: mpi.py)

Each rank gets its identity and the job's settings through UNISON_*
environment variables. Output lines are prefixed with the rank. Ctrl-C and
SIGTERM are forwarded to every rank. When a rank fails, the others get a
short grace period to report the failure themselves (their pending
collectives fail with an error naming the dead rank), then are stopped; the
launcher exits non-zero naming the rank and its exit status.
"""
import importlib.util
import os
import signal
import sys

from unison import basics
from unison.runner import command_line, elastic_driver, local, mpi, rank_environment, ssh
from unison.runner.processes import Job, new_job_id
from unison.version import VERSION


def compiled_paths():
    """{framework: the path its per-tensor work takes here, in words} for
    the installed frameworks whose adapter has a compiled one. Importing
    the adapter builds its extension where no cached build fits, as the
    first training script would."""
    from unison import adapter_extension
    for module, adapter, label in [("torch", "unison.torch", "PyTorch"),
                                   ("tensorflow", "unison.tensorflow", "TensorFlow")]:
        if importlib.util.find_spec(module) is None:
            continue
        try:
            importlib.import_module(adapter)
            if label == "TensorFlow" and adapter_extension.ACTIVE.get(label, "").startswith("compiled"):
                # Its XLA lowering is built at the first collective traced under XLA: build it now.
                importlib.import_module("unison.tensorflow.kernels").xla_problem()
        except Exception as e:  # noqa: BLE001 - reported, not raised: this is a diagnosis
            adapter_extension.ACTIVE.setdefault(label, "%s does not import: %s" % (adapter, e))
    return dict(adapter_extension.ACTIVE)


def check_build():
    def mark(present):
        return "[X]" if present else "[ ]"

    frameworks = [("NumPy", "numpy"), ("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("MXNet", "mxnet")]
    built = basics.built_backends()
    lines = ["unison v%s:" % VERSION, "", "Available Frameworks:"]
    for label, module in frameworks:
        lines.append("    %s %s" % (mark(importlib.util.find_spec(module) is not None), label))
    lines += ["", "Available Data Planes:",
              "    %s Shared memory (one host)" % mark("shm" in built),
              "    %s TCP (several hosts, no MPI)" % mark("tcp" in built),
              "    %s MPI (several hosts)" % mark("mpi" in built),
              "    %s NCCL (GPUs)" % mark(basics.nccl_built()),
              "    %s Host staging (GPUs without NCCL)" % mark(basics.cuda_built()),
              "", "GPU support (found at run time): " + basics.device_support()]
    paths = compiled_paths()
    if paths:
        lines += ["", "Compiled paths (built against the installed framework at first import):"]
        lines += ["    %s %s: %s" % (mark(path.startswith("compiled")), label, path) for label, path in paths.items()]
    print("\n".join(lines))
    return 0


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
    args = command_line.parse(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        return check_build()
    if command_line.through_mpirun(args):
        return mpi.launch(args, command_line.settings(args))
    environment = command_line.base_environment(args)
    if command_line.is_elastic(args):
        return elastic_driver.launch(args, new_job_id(), environment)
    job = Job(args)
    if command_line.across_hosts(args):
        launches = ssh.launches(args, job.job_id, environment)
    else:
        launches = local.launches(args, job.job_id, environment)

    signal.signal(signal.SIGINT, lambda signum, _frame: job.stop(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: job.stop(signum))
    job.start(launches)
    return job.wait()


if __name__ == "__main__":
    sys.exit(main())
