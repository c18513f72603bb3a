"""unison.spark.run_elastic: an elastic job whose workers are Spark tasks.

A barrier stage is all or nothing, so an elastic job runs as an ordinary
stage of max_num_proc tasks instead, driven by unisonrun's elastic driver
(runner/elastic_driver.py) in this process, as Horovod's run_elastic was:

- each task, once Spark starts it, connects to the driver's task pool
  (with the job's secret, like every elastic worker's connection) and says
  which host it is on; the hosts the driver sees are the hosts of the
  tasks that are running, each with a slot per task;
- when a round wants a worker on a host, an idle task there runs
  fn(*args, **kwargs) as that worker, whose init() joins the round; when
  it ends, the task waits for the next call;
- a task whose process dies is a worker that failed: its host is
  blacklisted (for cooldown_range, or for good), the round's survivors roll
  back to their last commit, and Spark starts the task again
  (spark.task.maxFailures), which brings its slot back once the host is off
  the blacklist;
- the job ends when a member of the last round returns; run_elastic returns
  what that round's ranks returned, in rank order, and ends the waiting
  tasks, which ends the stage.
"""
import os
import queue
import sys
import threading

from unison import engine_worker, keyed_listener, network
from unison.keyed_listener import KeyedListener
from unison.runner import command_line
from unison.runner.elastic_driver import ElasticDriver
from unison.runner.processes import new_job_id
from unison.spark.task import environment


class PooledTask:
    """A running Spark task, as the driver sees it through its connection."""

    def __init__(self, connection, host):
        self.connection, self.host = connection, host
        self.busy = False
        self.alive = True
        self.outcome = None
        self.changed = threading.Condition()


class TaskProcess:
    """A worker running in a pooled task, as the driver waits for and stops
    a worker's process (elastic_driver.WorkerProcess)."""

    def __init__(self, task, on_outcome):
        self.task, self.on_outcome = task, on_outcome

    def wait(self):
        with self.task.changed:
            while self.task.alive and self.task.outcome is None:
                self.task.changed.wait()
            outcome = self.task.outcome or {"code": -9, "error": "its Spark task's process died"}
            self.task.outcome = None
        self.on_outcome(outcome)
        return outcome["code"]

    def stop(self, signum):
        try:
            self.task.connection.send({"kind": "stop"})
        except (OSError, ValueError):
            pass


class SparkElasticDriver(ElasticDriver):
    def __init__(self, argv, env, bind):
        super().__init__(command_line.parse(argv + ["--host-discovery-script", "(Spark's tasks)", "(fn)"]),
                         "spark-" + new_job_id(), {})
        self.env, self.bind = env, bind
        self.tasks = []  # PooledTask, in the order they registered
        self.outcomes = {}  # worker name -> its last run's outcome
        self.ending = False
        self.pool = KeyedListener(bind, self.secret.encode(), self.serve_task,
                                  lambda e: self.say("refused a connection to the task pool: %s" % e))

    def say(self, message):
        sys.stderr.write("unison.spark: %s\n" % message)
        sys.stderr.flush()

    def hosts_are_fixed(self):
        return False

    def listen_address(self, hosts):
        return self.bind

    def serve_task(self, connection):
        try:
            hello = connection.recv()
        except (EOFError, OSError):
            return
        task = PooledTask(connection, hello["host"])
        with self.lock:
            if self.ending:
                connection.send({"kind": "end"})
                return
            self.tasks.append(task)
            self.lock.notify_all()
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break
            with task.changed:
                task.outcome, task.busy = message, False
                task.changed.notify_all()
        with self.lock:
            self.tasks.remove(task)
            self.lock.notify_all()
        with task.changed:
            task.alive = False
            task.changed.notify_all()

    def discover(self):
        hosts = {}
        with self.lock:
            for task in self.tasks:
                hosts[task.host] = hosts.get(task.host, 0) + 1
        return hosts

    def launch(self, name, host, identity):
        # Called by step(), with the lock held.
        idle = [t for t in self.tasks if t.host == host and not t.busy and t.alive]
        if not idle:
            # The host's tasks were counted before one of them died (hosts
            # are looked at every second): this worker is lost with it.
            task = PooledTask(None, host)
            task.alive = False
        else:
            task = idle[0]
            task.busy = True
            try:
                task.connection.send({"kind": "run", "env": dict(self.env, **identity)})
            except (OSError, ValueError):
                pass  # the task is gone: serve_task sees it, and wait() says so

        def keep(outcome):
            self.outcomes[name] = outcome
        return TaskProcess(task, keep)

    def end_tasks(self):
        with self.lock:
            self.ending = True
            tasks = list(self.tasks)
        for task in tasks:
            try:
                task.connection.send({"kind": "end"})
            except (OSError, ValueError):
                pass
        self.pool.close()


def task_loop(pool_address, secret, driver_host, fn, args, kwargs):
    """A Spark task's part: runs fn(*args, **kwargs) as a worker each time
    the driver asks, until it says the job has ended."""
    connection = keyed_listener.connect(pool_address, secret.encode())
    connection.send({"host": network.route_source(driver_host)})
    calls = queue.Queue()

    def listen():
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                calls.put({"kind": "end"})
                return
            if message["kind"] == "stop":
                os._exit(1)  # the driver stops this worker; Spark starts the task again
            calls.put(message)

    threading.Thread(target=listen, name="unison-spark-task-pool", daemon=True).start()
    while True:
        message = calls.get()
        if message["kind"] == "end":
            connection.close()
            return
        with environment(message["env"]):
            outcome = engine_worker.run_as_elastic_worker(fn, args, kwargs)
        connection.send(outcome)
