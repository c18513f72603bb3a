"""The elastic launcher with no framework (unison.elastic.ObjectState over
numpy): a job that survives a failure ends with the exact sum of its
committed steps; repeated failures past --reset-limit, and too few slots
for longer than --elastic-timeout, end the job with the reason; bad
elastic options are refused by name."""
import os
import re
import time

import pytest

from jobs import discovery_script, elastic_job, run_random_kills, unisonrun
from test_tcp import fake_ssh
from unison import timeline

pytestmark = pytest.mark.timeout(300)
STEPS = 20


def done_events(events):
    return [e for worker in events.values() for e in worker if e["event"] == "done"]


@pytest.mark.parametrize("hosts,victim", [("localhost:1,127.0.0.1:1", "127.0.0.1:0"),
                                          ("localhost:2,127.0.0.1:1", "127.0.0.1:0")], ids=["np2", "np3"])
def test_object_state_survives_a_killed_worker(tmp_path, hosts, victim):
    np_ = sum(int(h.split(":")[1]) for h in hosts.split(","))
    trace = tmp_path / "t.json"
    proc, events = elastic_job(tmp_path, ["-np", str(np_), "--min-np", "1", "-H", hosts,
                                          "--timeline-filename", str(trace)], "train_numpy.py",
                               env={"ELASTIC_FAULT": "%s@7:sigkill" % victim, "ELASTIC_STEPS": str(STEPS)})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    # A timeline per round: round 1's rank 0 does not overwrite round 0's.
    for path in (trace, tmp_path / "t.round1.json"):
        assert "share" in {row for row, *_ in timeline.spans(timeline.load(str(path)))}, path
    done = done_events(events)
    survivors = np_ - 1 if np_ == 2 else 2
    assert len(done) == survivors, done
    # Every step's Sum is step + 1: the total of the committed steps, exactly.
    expected = sum(range(1, STEPS + 1))
    for e in done:
        assert e["step"] == STEPS and e["total"] == [expected] * 3, e


def test_a_worker_that_dies_as_it_joins_a_round_ends_that_rounds_start_up_at_once(tmp_path):
    """127.0.0.2:0 dies at step 5; the driver places 127.0.0.1:0 in round 1,
    and it dies before it reaches rank 0. Nothing of it is left for rank 0
    to see: it would wait for it until UNISON_START_TIMEOUT. The driver saw
    it die, and the worker's watch on the driver ends rank 0's start-up."""
    start = time.monotonic()
    proc, events = elastic_job(tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1"],
                               "train_numpy.py", env={"ELASTIC_FAULT": "127.0.0.2:0@5:sigkill",
                                                      "ELASTIC_DIE_JOINING": "127.0.0.1:0@1",
                                                      "ELASTIC_STEPS": str(STEPS), "UNISON_START_TIMEOUT": "100"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    assert time.monotonic() - start < 40, output[-6000:]
    assert re.search(r"\[localhost:0\]<stderr>:unison: worker localhost:0: round 1 did not start: unison: start-up "
                     r"ended: worker 127\.0\.0\.1:0 of round 1 was killed by signal 9 \(SIGKILL\); joining the next",
                     output), output[-6000:]
    done = done_events(events)
    assert [(e["worker"], e["size"], e["step"]) for e in done] == [("localhost:0", 1, STEPS)], done
    assert done[0]["total"] == [sum(range(1, STEPS + 1))] * 3


@pytest.mark.parametrize("seed", range(16))
def test_workers_killed_at_random_moments_leave_the_exact_sum_of_the_committed_steps(tmp_path, seed):
    """Seed 16 of the first draws ended the job: a second worker died while
    the survivors of the first started their next round, and they let
    init's error end them (now they go on to the round after), or waited
    for the dead one until the driver took them for hung (now start-up
    sees it go)."""
    run_random_kills(tmp_path, seed, host_added=False, steps=STEPS)


@pytest.mark.parametrize("seed", range(16))
def test_a_host_added_while_workers_are_killed_at_random_moments_leaves_the_exact_sum(tmp_path, seed):
    """Hosts found by a discovery script, one added mid-job, kills anywhere
    (jobs.random_kills). Seeds 16, 17, 21 and 30 of the first draws ended
    a newcomer whose first round lost a member as it started: its init()
    failed and its host was blacklisted. Now it joins the next round."""
    run_random_kills(tmp_path, seed, host_added=True, steps=60)


@pytest.mark.parametrize("hosts", ["localhost:1,127.0.0.1:1", "localhost:2,127.0.0.1:1"], ids=["np2", "np3"])
def test_a_deadlock_ends_an_elastic_job_instead_of_resetting_it(tmp_path, hosts):
    # Rank 0 takes another branch at step 5. Every rank gets DeadlockError,
    # which hvd.elastic.run passes on, as it does a mismatch: a reset would
    # only replay the same code path into the same deadlock.
    np_ = sum(int(h.split(":")[1]) for h in hosts.split(","))
    proc, events = elastic_job(tmp_path, ["-np", str(np_), "--min-np", "1", "-H", hosts,
                                          "--stall-check-warning-time-seconds", "1.5"], "train_numpy.py",
                               env={"ELASTIC_BRANCH_AT": "5", "ELASTIC_STEPS": "20"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output[-6000:]
    assert output.count("unison.exceptions.DeadlockError: unison: deadlock: every rank is blocked") == np_, \
        output[-6000:]
    assert re.search(r"allreduce 'extra' waited \d+ s: submitted by ranks \[0\]", output), output[-6000:]
    assert len(events) == np_, events
    for worker in events.values():
        assert [e["event"] for e in worker].count("sync") == 1, worker  # never reset
        assert not [e for e in worker if e["event"] == "done"], worker


def test_c_failures_past_the_reset_limit_end_the_job(tmp_path):
    # The host comes back after its cooldown, and its new worker fails again.
    proc, events = elastic_job(tmp_path, ["-np", "2", "--min-np", "1", "--reset-limit", "2",
                                          "--blacklist-cooldown-range", "0.5", "1", "-H", "localhost:1,127.0.0.1:1"],
                               "train_numpy.py", env={"ELASTIC_FAULT": "127.0.0.1:0@3+:exit", "ELASTIC_STEPS": "400"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output[-6000:]
    assert "blacklisting host 127.0.0.1 for 0.5 s" in output and "blacklisting host 127.0.0.1 for 1 s" in output
    assert "job failed: the job has re-formed 2 times (--reset-limit 2) and would have to again" in output, \
        output[-3000:]
    assert not done_events(events)


def test_d_too_few_slots_for_longer_than_the_timeout_end_the_job(tmp_path):
    script, _ = discovery_script(tmp_path, ["localhost:1", "127.0.0.1:1"])
    proc, _ = elastic_job(tmp_path, ["-np", "2", "--elastic-timeout", "2", "--host-discovery-script", script],
                          "train_numpy.py", env={"ELASTIC_FAULT": "127.0.0.1:0@3:sigkill", "ELASTIC_STEPS": "400"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, output[-6000:]
    assert "1 slots available, fewer than --min-np 2: waiting up to 2 s (--elastic-timeout)" in output
    assert "job failed: only 1 slots were available, fewer than --min-np 2, for 2 s (--elastic-timeout)" in output


def test_d_fixed_hosts_that_cannot_return_end_the_job_at_once(tmp_path):
    proc, _ = elastic_job(tmp_path, ["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1"],
                          "train_numpy.py", env={"ELASTIC_FAULT": "127.0.0.1:0@3:sigkill", "ELASTIC_STEPS": "400"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0
    assert "only 1 slots are left, fewer than --min-np 2, and the hosts are fixed" in output, output[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_command_that_never_calls_init_ends_the_job_when_it_ends(np_):
    """A worker that ended with success before it ever asked to join a round
    was started again, about a hundred times a second, for good."""
    proc = unisonrun(["-np", str(np_), "--min-np", "1", "--verbose"],
                     ["sh", "-c", "echo ran on $UNISON_ELASTIC_WORKER"], timeout=50)
    output = proc.stdout.decode(errors="replace")  # the launcher's lines too
    assert proc.returncode == 0, output
    workers = ["localhost:%d" % i for i in range(np_)]
    assert sorted(output.splitlines()) == sorted(
        ["[%s]<stdout>:ran on %s" % (w, w) for w in workers]
        + ["unisonrun: starting worker %s: sh -c echo ran on $UNISON_ELASTIC_WORKER" % w for w in workers]
        + ["unisonrun: hosts now localhost:%d" % np_]), output


def test_a_failing_discovery_script_keeps_the_hosts_found_before(tmp_path):
    script, listing = discovery_script(tmp_path, ["localhost:2"])
    with open(script, "a") as f:
        f.write("if test -e %s.added; then echo 'not a host line: x'; exit 1; fi\n" % listing)
    proc, events = elastic_job(tmp_path, ["-np", "2", "--host-discovery-script", script], "train_numpy.py",
                               env={"ELASTIC_ADD": "2:%s:#" % listing, "ELASTIC_STEPS": "100"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-4000:]
    assert "--host-discovery-script %s failed (exited with status 1" % script in output, output[-3000:]
    assert len(done_events(events)) == 2


def test_workers_on_a_host_reached_by_ssh(tmp_path):
    # elsewhere.invalid is not this machine, so its workers start through
    # "ssh" (test_tcp.py's stand-in, which runs the command here in a fresh
    # login environment), get the secret and the launcher's environment
    # (ELASTIC_FAULT, ELASTIC_STEPS) on its standard input, and reach the
    # driver over lo.
    ssh = fake_ssh(tmp_path)
    proc, events = elastic_job(tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:1,elsewhere.invalid:2",
                                          "--network-interface", "lo"], "train_numpy.py",
                               env={"UNISON_SSH": str(ssh), "ELASTIC_FAULT": "elsewhere.invalid:1@7:sigkill",
                                    "ELASTIC_STEPS": str(STEPS)})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    assert "round 0: 3 workers (localhost:1, elsewhere.invalid:2)" in output
    assert "unisonrun: worker elsewhere.invalid:1 was killed by signal 9" in output, output[-3000:]
    assert "blacklisting host elsewhere.invalid" in output and "round 1: 1 workers (localhost:1)" in output
    done = done_events(events)
    assert [e["worker"] for e in done] == ["localhost:0"]
    assert done[0]["total"] == [sum(range(1, STEPS + 1))] * 3
    # Each round tells every worker who it is under horovodrun's names too.
    syncs = [e for worker in events.values() for e in worker if e["event"] == "sync"]
    assert len(syncs) >= 4, events
    for e in syncs:
        assert e["horovods_names"] == {"RANK": str(e["rank"]), "SIZE": str(e["size"]),
                                       "LOCAL_RANK": str(e["local_rank"]), "HOSTNAME": e["worker"].split(":")[0]}, e


def test_a_plain_job_using_the_elastic_api_fails_at_once_when_a_rank_dies(tmp_path):
    # No elastic launcher to form another round: the survivor raises the
    # error instead of trying to re-initialise with a dead peer.
    proc, events = elastic_job(tmp_path, ["-np", "2"], "train_numpy.py",
                               env={"ELASTIC_FAULT": "rank1@5:sigkill", "ELASTIC_STEPS": "400"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0
    assert "[0]<stderr>:unison.exceptions.RankFailedError: unison: rank 1 (pid" in output, output[-3000:]
    assert [e["step"] for e in events["rank0"] if e["event"] == "detected"] == [5]


@pytest.mark.parametrize("options,message", [
    (["--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    (["--min-np", "0"], "--min-np 0: at least 1"),
    (["--reset-limit", "-1", "--min-np", "1"], "--reset-limit -1: at least 0"),
    (["--elastic-timeout", "0", "--min-np", "1"], "--elastic-timeout 0: more than 0"),
    (["--blacklist-cooldown-range", "5", "1", "--min-np", "1"], "--blacklist-cooldown-range 5 1: 0 <= LOW <= HIGH"),
    (["--min-np", "1", "--mpi"], "runs over TCP, not --mpi"),
    (["--host-discovery-script", "true", "-H", "localhost:2"], "both name the hosts"),
    (["--reset-limit", "2"], "--reset-limit only apply to an elastic job"),
])
def test_bad_elastic_options_are_refused_by_name(options, message):
    proc = unisonrun(["-np", "2"] + options, ["true"], timeout=60)
    assert proc.returncode == 2 and message in proc.stdout.decode(), proc.stdout.decode()


def test_a_worker_offers_a_rendezvous_port_the_kernel_never_hands_out_by_itself(monkeypatch):
    # The port a worker offers goes unheld for a moment before its init()
    # listens on it: see network.bind_a_port_nobody_takes_by_chance.
    from unison import elastic_worker as worker, network

    monkeypatch.setenv(worker.DRIVER, "127.0.0.1:9")
    monkeypatch.delenv("UNISON_NETWORK_INTERFACE", raising=False)
    low, high = network.ephemeral_ports()
    address, port, held = worker._listen_address()
    try:
        assert address == "127.0.0.1" and not low <= port <= high and held.getsockname() == (address, port)
    finally:
        held.close()


def test_an_engine_worker_leaves_the_environment_as_it_found_it(monkeypatch):
    # A Ray actor or a Spark Python worker runs one job's rank after
    # another: a round's settings from the elastic driver must not outlive
    # the worker (a stale UNISON_ELASTIC_ROUND named the next rank's shared
    # memory where its peers never looked).
    from unison import engine_worker
    monkeypatch.delenv("UNISON_ELASTIC_ROUND", raising=False)
    monkeypatch.setenv("UNISON_TEST_KEPT", "as it was")

    def worker():
        os.environ["UNISON_ELASTIC_ROUND"] = "2"   # as elastic_worker writes a round's settings
        os.environ["UNISON_TEST_KEPT"] = "changed"
        return "done"

    def failing():
        os.environ["UNISON_ELASTIC_ROUND"] = "3"
        raise RuntimeError("lost a peer")

    assert engine_worker.run_as_elastic_worker(worker, (), {}) == {"code": 0, "result": "done"}
    assert "UNISON_ELASTIC_ROUND" not in os.environ and os.environ["UNISON_TEST_KEPT"] == "as it was"
    outcome = engine_worker.run_as_elastic_worker(failing, (), {})
    assert outcome["code"] == 1 and "lost a peer" in outcome["error"]
    assert "UNISON_ELASTIC_ROUND" not in os.environ and os.environ["UNISON_TEST_KEPT"] == "as it was"
