"""What the elastic test jobs share: an event log per worker, and the
faults and host changes a test asks for, in the environment:

  ELASTIC_LOG      folder for each worker's events (one JSON line each)
  ELASTIC_FAULT    worker@step:how (how: sigkill, sigstop or exit; worker:
                   host:slot, or rankN in a plain job); the worker does it
                   at that step, whichever round it is in;
                   worker@step+:how does it at every step from then on
  ELASTIC_ADD      step:file:line; rank 0 appends the line to the file (the
                   discovery script's) once, when it reaches that step
  ELASTIC_GROW_TO  the size the job waits for after that (wait_for_growth)
  ELASTIC_KILL_AFTER  worker:ms[,worker:ms...]; the worker SIGKILLs itself
                   that many milliseconds after its first step began,
                   wherever it is then (a collective, a commit, a reset),
                   unless its last step has begun (timed_kill_window)
  ELASTIC_DIE_JOINING  worker@round; the worker SIGKILLs itself as soon as
                   the driver places it in that round, before it reaches
                   any other rank
"""
import json
import os
import signal
import threading
import time

# An elastic worker's name (host:slot), or rankN in a plain job.
WORKER = os.environ.get("UNISON_ELASTIC_WORKER") or "rank" + os.environ.get("UNISON_RANK", "0")


def log(**event):
    folder = os.environ.get("ELASTIC_LOG")
    if folder:
        event.update(worker=WORKER, time=time.time())
        with open(os.path.join(folder, WORKER.replace(":", "_") + ".jsonl"), "a") as f:
            f.write(json.dumps(event) + "\n")


def log_end_of_keras_job(model, step, rank, size):
    """Rank 0's final weights (the dense layer's), then every rank's end."""
    if rank == 0:
        weights = model.get_weights()
        log(event="final", size=size, step=step,
            params={"weight": weights[0].flatten().tolist(), "bias": weights[1].flatten().tolist()})
    log(event="done", rank=rank, size=size)


_timed_kill = {"armed": False, "window_open": True, "lock": threading.Lock()}


def timed_kill_window(step, steps):
    """ELASTIC_KILL_AFTER: a kill at a moment no step boundary chooses. The
    first call starts the clock; the window closes as the last step begins,
    so that a kill always leaves the others a collective that needs the
    victim (one after their last would end the job as a failure, as
    Horovod's driver does, and the test could not say which to expect)."""
    with _timed_kill["lock"]:
        if step >= steps - 1:
            _timed_kill["window_open"] = False
        if _timed_kill["armed"]:
            return
        _timed_kill["armed"] = True
    for entry in filter(None, os.environ.get("ELASTIC_KILL_AFTER", "").split(",")):
        name, _, ms = entry.rpartition(":")
        if name == WORKER:
            threading.Thread(target=_kill_after, args=(int(ms) / 1000,), daemon=True).start()


def _kill_after(seconds):
    time.sleep(seconds)
    with _timed_kill["lock"]:
        if _timed_kill["window_open"]:
            log(event="fault", how="timed")
            os.kill(os.getpid(), signal.SIGKILL)


def _die_joining():
    spec = os.environ.get("ELASTIC_DIE_JOINING")
    if not spec or spec.partition("@")[0] != WORKER:
        return
    from unison import elastic_worker as worker
    join_round, fatal = worker.join_round, int(spec.partition("@")[2])

    def joins_and_dies():
        held = join_round()
        if int(os.environ["UNISON_ELASTIC_ROUND"]) == fatal:
            log(event="fault", how="joining")
            os.kill(os.getpid(), signal.SIGKILL)
        return held
    worker.join_round = joins_and_dies


_die_joining()


def fault_at(step):
    spec = os.environ.get("ELASTIC_FAULT")
    if not spec:
        return
    name, _, rest = spec.partition("@")
    at, _, how = rest.partition(":")
    from_then_on = at.endswith("+")
    at = int(at.rstrip("+"))
    if name != WORKER or step < at or (step > at and not from_then_on):
        return
    log(event="fault", how=how, step=step)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        os._exit(3)


def maybe_add_host(step, rank):
    spec = os.environ.get("ELASTIC_ADD")
    if spec and rank == 0:
        at, path, line = spec.split(":", 2)
        if int(at) == step and not os.path.exists(path + ".added"):
            open(path + ".added", "w").close()
            with open(path, "a") as f:
                f.write(line + "\n")
            log(event="added", line=line, step=step)


def wait_for_growth(step, size, commit):
    """With ELASTIC_GROW_TO=N, from the step after ELASTIC_ADD's on, every
    rank commits and waits until the job has N ranks (the commit raises
    HostsUpdatedInterrupt once the driver sees the new host), so that a
    slow-starting newcomer cannot miss a short job."""
    spec, target = os.environ.get("ELASTIC_ADD"), int(os.environ.get("ELASTIC_GROW_TO", "0"))
    if spec and size < target and step > int(spec.split(":", 1)[0]):
        while True:
            time.sleep(0.05)
            commit()


def train_from_the_commit(state, rank, size, train_on):
    """The loop of the TensorFlow jobs, inside hvd.elastic.run: from the
    committed step on, train_on(x, y) with this rank's share of each of
    reference.py's global batches, committing after every step, with the
    faults and host changes the test asked for."""
    from reference import STEPS, batch_of
    log(event="sync", rank=rank, size=size, step=state.step)
    while state.step < STEPS:
        fault_at(state.step)
        maybe_add_host(state.step, rank)
        wait_for_growth(state.step, size, state.commit)
        x, y = batch_of(state.step)
        train_on(x[rank::size], y[rank::size])
        state.step += 1
        state.commit()
