"""A rank that an engine runs inside a process the engine keeps (a Ray
actor's call, a Spark task in a reused Python worker), not in a process of
its own: what unison.ray and unison.spark do around the user's function,
where under unisonrun the process's exit would do it."""
import contextlib
import os
import sys
import traceback

from unison import basics, elastic_worker


@contextlib.contextmanager
def leaving_the_job_on_error():
    """Ends this rank's unison when what it runs raises, before the error
    goes back to the engine. A rank's process that fails under unisonrun
    exits, and the other ranks' collectives with it fail at once, naming it;
    a process the engine keeps outlives the call, and without this the
    others would wait in their collectives for it for ever. The next call's
    init() starts unison again."""
    try:
        yield
    except BaseException:
        if basics.is_initialized():
            basics.shutdown()
        raise


def run_as_elastic_worker(fn, args, kwargs):
    """fn(*args, **kwargs) as one worker of an elastic job, as a worker
    process runs its script: {"code": 0, "result": ...}, or the status a
    process would have exited with and why ({"code", "error"}). A worker the
    driver dismisses or ends leaves init() with SystemExit, as a process
    would exit. Afterwards unison is shut down, the driver's connection
    forgotten and the environment put back as it was, so that the process
    can run another worker, or another job's rank, later: each round's
    settings from the driver (UNISON_ELASTIC_ROUND among them) go into
    os.environ, and a Spark task's next rank in the same Python worker
    named its shared memory after the stale round, where its peers never
    looked (CI saw unison.spark.run fail after a failed elastic job)."""
    environment = dict(os.environ)
    try:
        return {"code": 0, "result": fn(*args, **kwargs)}
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return {"code": code, "error": None if e.code in (None, 0) else str(e.code)}
    except BaseException:
        return {"code": 1, "error": traceback.format_exc()}
    finally:
        if basics.is_initialized():
            basics.shutdown()
        elastic_worker.forget_the_driver()
        if dict(os.environ) != environment:
            os.environ.clear()
            os.environ.update(environment)
        sys.stdout.flush()
        sys.stderr.flush()
