"""What each task of unison.spark.run's barrier stage runs: it becomes one
rank of a unison job, runs the function, and hands back what it returned
or raised.

The tasks of a barrier stage start together, and BarrierTaskContext's
allGather lets them trade one message each through Spark's driver before
anything else happens. Each task sends where it runs; task 0 adds a
rendezvous port free on its host and a fresh secret. Every task then knows
every rank's host, so it computes its identity as unisonrun would have
given it (rank = the task's partition; tasks of one host share memory;
hosts meet over the TCP plane). The secret crosses Spark's own RPC, so it
is as safe as the Spark application: whoever can talk to its driver can
already run code in its executors.

A task runs in one of Spark's Python workers, which Spark reuses for later
tasks. So the task leaves it as it found it: the variables it set are
restored, and unison is shut down at the end, whether the function
returned or raised (a rank that raised leaves the job at once, so the
others' collectives fail naming it instead of waiting for it).
"""
import contextlib
import io
import json
import os
import secrets
import sys
import time
import traceback

from unison import basics, network
from unison.runner import rank_environment


def _messages(context, mine):
    return [json.loads(m) for m in context.allGather(json.dumps(mine))]


@contextlib.contextmanager
def environment(variables):
    """`variables` set while the block runs; the environment as it was after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.pop(basics.INITIALIZED_BY, None)


@contextlib.contextmanager
def _captured(capture):
    """The task's Python output, kept for the driver when it asked for it."""
    if not capture:
        yield None
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def run_rank(fn, args, kwargs, settings):
    """One task's part: returns {"rank", "result"} or {"rank", "error",
    "failed_at"}, with its output when settings["capture"]."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    # The address from which this host reaches the driver is one the
    # driver's other hosts reach too.
    interface = settings["env"].get("UNISON_NETWORK_INTERFACE")
    if interface:
        address = network.interface_address(interface)
    else:
        address = network.route_source(settings["driver_host"])
    mine = {"address": address, "host": address}
    if rank == 0:
        mine.update(port=network.a_port_nobody_takes_by_chance(address), secret=secrets.token_hex(32),
                    job=secrets.token_hex(16))
    everyone = _messages(context, mine)
    first = everyone[0]
    hosts = [m["host"] for m in everyone]
    identity = dict(settings["env"], **rank_environment.placed_identities(hosts)[rank])
    # Named by rank 0 afresh: each run, and each attempt Spark makes of one,
    # is a job of its own, with its own shared memory.
    identity["UNISON_JOB_ID"] = "spark-" + first["job"]
    if len(set(hosts)) > 1:
        identity.update(UNISON_RENDEZVOUS_ADDR=first["address"], UNISON_RENDEZVOUS_PORT=str(first["port"]),
                        UNISON_SECRET_KEY=first["secret"])
    outcome = {"rank": rank}
    with environment(identity), _captured(settings["capture"]) as output:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException:
            outcome.update(error=traceback.format_exc(), failed_at=time.time())
        finally:
            if basics.is_initialized():
                basics.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
    if output is not None:
        outcome.update(stdout=output[0].getvalue(), stderr=output[1].getvalue())
    return outcome
