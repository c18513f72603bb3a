"""unison.spark: Horovod's horovod.spark.run on Spark, with horovod replaced
by unison.

    from pyspark.sql import SparkSession
    import unison.spark

    spark = SparkSession.builder.getOrCreate()
    results = unison.spark.run(train, args=(0.01,), num_proc=4)   # [rank 0's return value, rank 1's, ...]

Spark schedules the ranks, as one barrier stage of num_proc tasks (Spark's
barrier execution mode starts all of them together or none, and ends all
of them if one fails); unison runs their collectives: shared memory among
the tasks of a host, its TCP plane across hosts, with a secret made per run
(task.py). No MPI, ssh or launcher is needed on the executors, only
unison installed where their Python runs.

run_elastic (elastic.py) runs an elastic job on an ordinary stage, since a
barrier stage is all or nothing.

What Horovod's Spark integration had and this does not: the estimators
(horovod.spark.keras/torch/lightning: KerasEstimator, TorchEstimator), a
data pipeline and model-fitting framework of their own on top of Petastorm
rather than a way of running ranks.
"""
import re
import sys
import time

from unison import network
from unison.spark import task

__all__ = ["run", "run_elastic"]


def _active_context():
    from pyspark import SparkContext
    context = SparkContext._active_spark_context
    if context is None:
        raise ValueError("unison.spark.run: no SparkContext is running in this process: start one first "
                         "(SparkSession.builder.getOrCreate())")
    return context


def run(fn, args=(), kwargs=None, num_proc=None, start_timeout=None, env=None, stdout=None, stderr=None, verbose=1,
        nics=None, prefix_output_with_timestamp=False):
    """Runs fn(*args, **kwargs) as num_proc unison ranks in Spark tasks and
    returns what each returned, in rank order.

    num_proc: the ranks (default: the context's defaultParallelism); the
    cluster must have that many task slots free at once, or Spark refuses
    the barrier stage. start_timeout: how long the ranks wait for each
    other in init(), in seconds. env: variables every rank gets. stdout,
    stderr: streams that get the ranks' Python output, each line prefixed
    with its rank, once the ranks end (without them the output stays where
    Spark puts a task's: the executors' logs, or this terminal in local
    mode). nics: the one network interface the ranks use across hosts.
    A rank whose fn raises fails the run with a RuntimeError naming it and
    carrying its traceback."""
    context = _active_context()
    num_proc = context.defaultParallelism if num_proc is None else num_proc
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError("unison.spark.run: num_proc=%r: give a number of ranks, at least 1" % (num_proc,))
    variables = _rank_variables(env, start_timeout, nics, "unison.spark.run")
    settings = {"env": variables, "driver_host": context.getConf().get("spark.driver.host", "localhost"),
                "capture": stdout is not None or stderr is not None}
    kwargs = dict(kwargs or {})
    args = tuple(args)

    def rank_task(_partition):
        yield task.run_rank(fn, args, kwargs, settings)

    _wait_for_slots(context, num_proc, start_timeout if start_timeout is not None else _SLOT_WAIT_SECONDS)
    if verbose:
        print("unison.spark: running %s on %d ranks as a barrier stage" % (getattr(fn, "__name__", fn), num_proc),
              file=sys.stderr, flush=True)
    context.setJobDescription("unison.spark.run(%s) on %d ranks" % (getattr(fn, "__name__", fn), num_proc))
    try:
        outcomes = context.parallelize(range(num_proc), num_proc).barrier().mapPartitions(rank_task).collect()
    except Exception as e:
        raise RuntimeError("unison.spark.run: Spark's barrier stage of %d ranks failed: %s"
                           % (num_proc, _why_spark_failed(e))) from e
    finally:
        context.setJobDescription(None)
    outcomes.sort(key=lambda o: o["rank"])
    _relay_output(outcomes, stdout, stderr, prefix_output_with_timestamp)
    failed = sorted((o for o in outcomes if "error" in o), key=lambda o: o["failed_at"])
    if failed:
        others = [o["rank"] for o in failed[1:]]
        raise RuntimeError("unison.spark.run: rank %d of %d failed first%s:\n%s" % (
            failed[0]["rank"], num_proc, " (then ranks %s, which lost it)" % others if others else "",
            failed[0]["error"]))
    return [o["result"] for o in outcomes]


def _rank_variables(env, start_timeout, nics, caller):
    """The variables every rank gets: the caller's env, with start_timeout
    and nics as the core's settings; a bad one is refused, naming it."""
    if start_timeout is not None and not start_timeout > 0:
        raise ValueError("%s: start_timeout=%r: give a number of seconds, more than 0" % (caller, start_timeout))
    variables = {str(k): str(v) for k, v in (env or {}).items()}
    if start_timeout is not None:
        variables["UNISON_START_TIMEOUT"] = str(start_timeout)
    interface = network.one_interface(nics, caller)
    if interface:
        variables["UNISON_NETWORK_INTERFACE"] = interface
    return variables


# How long run() waits for the cluster to have num_proc task slots when no
# start_timeout is given: as long as Horovod's Spark runner waited for its
# tasks to start (HOROVOD_SPARK_START_TIMEOUT's default).
_SLOT_WAIT_SECONDS = 600


def _free_slots(context):
    """How many tasks Spark could run at once now, or None where this Spark
    does not say. (A barrier stage that needs more is refused, but only
    after Spark's own check has failed 40 times 15 s apart: ten minutes of
    silence.)"""
    try:
        spark = context._jsc.sc()
        return spark.maxNumConcurrentTasks(spark.resourceProfileManager().defaultResourceProfile())
    except Exception:  # a Spark without these (they are Spark's own, not public API)
        return None


def _wait_for_slots(context, num_proc, timeout):
    """Returns once the cluster has num_proc task slots (executors may still
    be joining), or raises after `timeout` seconds, naming what it has."""
    deadline = time.monotonic() + timeout
    while True:
        slots = _free_slots(context)
        if slots is None or slots >= num_proc:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                "unison.spark.run: num_proc=%d ranks need %d task slots at once (Spark runs them as one barrier "
                "stage), but this Spark application has %d (after waiting %g s, start_timeout): ask for fewer "
                "ranks, or for more executors or cores" % (num_proc, num_proc, slots, timeout))
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _end_group(context, group, timeout=60.0):
    """Cancels what is left of a job group's stages (a failed task's retry,
    started after the job's end, which would fail anyway) and returns once
    none of their tasks runs: the application's next stage (the next run,
    a barrier stage that needs every slot) then starts with every task slot
    and Python worker free, not beside a task Spark is still ending."""
    context.cancelJobGroup(group)
    tracker = context.statusTracker()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stages = []
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            stages += list(job.stageIds) if job is not None else []
        infos = [tracker.getStageInfo(stage_id) for stage_id in stages]
        if not any(info is not None and info.numActiveTasks > 0 for info in infos):
            return
        time.sleep(0.1)


def _why_spark_failed(error):
    """The lines of a failed Spark job's error that say why: Spark's reason
    for ending the stage, and the last exception a Python worker raised
    (Py4J wraps both in a Java stack trace hundreds of lines long)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line.split("stage failure: ", 1)[1] for line in lines if "stage failure: " in line), None)
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*:", line)
              and not line.startswith(("py4j.", "org.apache.", "java."))]
    return "; ".join(part for part in (reason, raised[-1] if raised else None) if part) or lines[0]


def _relay_output(outcomes, stdout, stderr, timestamped):
    for stream_name, stream in (("stdout", stdout), ("stderr", stderr)):
        if stream is None:
            continue
        for outcome in outcomes:
            for line in outcome.get(stream_name, "").splitlines():
                stamp = time.strftime("%a %b %d %H:%M:%S %Y ") if timestamped else ""
                stream.write("%s[%d]<%s>:%s\n" % (stamp, outcome["rank"], stream_name, line))
        stream.flush()


def run_elastic(fn, args=(), kwargs=None, num_proc=None, min_num_proc=None, max_num_proc=None, start_timeout=None,
                elastic_timeout=None, reset_limit=None, cooldown_range=None, env=None, stdout=None, stderr=None,
                verbose=1, nics=None, prefix_output_with_timestamp=False, min_np=None, max_np=None):
    """Runs fn(*args, **kwargs) as an elastic job of Spark tasks (elastic.py)
    and returns what the ranks of its last round returned, in rank order.
    fn trains under hvd.elastic.run, as under `unisonrun --min-np`.

    num_proc: the ranks to start with (default: the context's
    defaultParallelism); min_num_proc/max_num_proc (Horovod's min_np/max_np
    too): the fewest the job trains with and the most it grows to (the
    stage has max_num_proc tasks). elastic_timeout, reset_limit and
    cooldown_range are unisonrun's --elastic-timeout, --reset-limit and
    --blacklist-cooldown-range. A failed rank's task is started again by
    Spark only while spark.task.maxFailures allows. stdout and stderr are
    accepted for Horovod's scripts; the workers' output stays where Spark
    puts a task's. A job that cannot go on raises RuntimeError with the
    reason and the first failed worker's traceback."""
    import threading
    from unison.spark import elastic

    context = _active_context()
    min_num_proc = min_num_proc if min_num_proc is not None else min_np
    max_num_proc = max_num_proc if max_num_proc is not None else max_np
    num_proc = context.defaultParallelism if num_proc is None else num_proc
    min_num_proc = num_proc if min_num_proc is None else min_num_proc
    max_num_proc = max(num_proc, min_num_proc) if max_num_proc is None else max_num_proc
    argv = ["-np", str(num_proc), "--min-np", str(min_num_proc), "--max-np", str(max_num_proc)]
    for flag, value in (("--elastic-timeout", elastic_timeout), ("--reset-limit", reset_limit)):
        if value is not None:
            argv += [flag, str(value)]
    if cooldown_range is not None:
        argv += ["--blacklist-cooldown-range"] + [str(s) for s in cooldown_range]
    variables = _rank_variables(env, start_timeout, nics, "unison.spark.run_elastic")
    local = context.master.startswith("local")
    driver = elastic.SparkElasticDriver(argv, variables, "127.0.0.1" if local else "0.0.0.0")
    driver_host = "127.0.0.1" if local else context.getConf().get("spark.driver.host")
    pool, secret = (driver_host, driver.pool.address[1]), driver.secret
    kwargs, args = dict(kwargs or {}), tuple(args)

    def worker_task(_partition):
        elastic.task_loop(pool, secret, driver_host, fn, args, kwargs)
        return iter(())

    group = "unison-elastic-%s" % driver.secret[:16]

    def stage():
        # A job group of its own, so that the job's end can cancel the
        # stage's retries (setJobGroup is per thread).
        context.setJobGroup(group, "unison.spark.run_elastic(%s)" % getattr(fn, "__name__", fn), True)
        try:
            context.parallelize(range(max_num_proc), max_num_proc).mapPartitions(worker_task).collect()
        except Exception as e:
            with driver.lock:
                driver.end(1, "the Spark stage of the job's tasks failed: %s" % _why_spark_failed(e))
                driver.lock.notify_all()

    if verbose:
        print("unison.spark: running %s as an elastic job of %d to %d ranks" % (
            getattr(fn, "__name__", fn), min_num_proc, max_num_proc), file=sys.stderr, flush=True)
    tasks = threading.Thread(target=stage, name="unison-spark-elastic-stage", daemon=True)
    tasks.start()
    try:
        status = driver.run()
    finally:
        driver.end_tasks()
        tasks.join(timeout=60)
        _end_group(context, group)
    if status != 0:
        failed = [(name, o) for name, o in driver.outcomes.items() if o["code"] != 0 and o.get("error")]
        detail = "" if not failed else "\nworker %s: %s" % (failed[0][0], failed[0][1]["error"])
        raise RuntimeError("unison.spark.run_elastic: the job failed: %s%s" % (driver.failure[1], detail))
    return [driver.outcomes[name]["result"] for name in driver.members]
