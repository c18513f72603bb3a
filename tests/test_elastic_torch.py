"""Elastic torch jobs under the elastic launcher, with two simulated hosts
(localhost and 127.0.0.1 are two host names for this machine): a worker
dies mid-epoch and the job finishes on the rest; a host appears and the job
grows. Every job's final parameters are checked against one process that
applies the same committed steps (tests/elastic/reference.py)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
from jobs import HERE, assert_only_the_killed_left, discovery_script, elastic_job, random_kills  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "elastic"))
from reference import STEPS, torch_reference  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def final_of(events):
    finals = [e for worker in events.values() for e in worker if e["event"] == "final"]
    assert len(finals) == 1, finals
    return finals[0]


def assert_reference_parameters(final):
    expected = torch_reference(final["step"])
    assert final["step"] == STEPS
    for name, values in expected.items():
        assert final["params"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("hosts,victim,survivors", [
    ("localhost:2,127.0.0.1:2", "127.0.0.1:1", 2),
    ("localhost:2,127.0.0.1:1", "127.0.0.1:0", 2),
    ("localhost:1,127.0.0.1:2", "127.0.0.1:0", 1),
], ids=["np4-to-2", "np3-to-2", "np3-to-1"])
@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_killed_worker_leaves_the_job_on_the_remaining_host(tmp_path, hosts, victim, survivors, how):
    np_ = sum(int(h.split(":")[1]) for h in hosts.split(","))
    proc, events = elastic_job(tmp_path, ["-np", str(np_), "--min-np", "1", "-H", hosts], "train_torch.py",
                               env={"ELASTIC_FAULT": "%s@9:%s" % (victim, how)})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    assert "blacklisting host 127.0.0.1: worker %s" % victim in output, output[-3000:]
    final = final_of(events)
    assert final["size"] == survivors
    assert_reference_parameters(final)
    resumed = [e for w in events.values() for e in w if e["event"] == "sync" and e["size"] == survivors]
    # From the last commit: step 9's, or step 10's when the victim had sent
    # its gradients before dying, so that step 9 still completed; the same on
    # every survivor.
    assert len(resumed) == survivors and len({e["step"] for e in resumed}) == 1, resumed
    assert resumed[0]["step"] in (9, 10), resumed


@pytest.mark.parametrize("seed", [3, 5, 12, 16, 23, 25])
def test_workers_killed_at_random_moments_leave_the_parameters_of_one_process(tmp_path, seed):
    """Random hosts and kills (jobs.random_kills); in seed 12 a second
    worker dies as the next round starts up, which used to end the job."""
    options, env, slots, _ = random_kills(seed, window_ms=1200)
    proc, events = elastic_job(tmp_path, options, "train_torch.py", env=env)
    survivors = assert_only_the_killed_left(proc, events, slots)
    final = final_of(events)
    assert final["size"] == survivors
    assert_reference_parameters(final)


def test_a_frozen_worker_is_killed_and_its_host_blacklisted(tmp_path):
    proc, events = elastic_job(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1",
                                          "--peer-timeout-seconds", "3"], "train_torch.py",
                               env={"ELASTIC_FAULT": "127.0.0.1:0@5:sigstop"})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    assert "127.0.0.1:0 did not rejoin" in output, output[-3000:]
    final = final_of(events)
    assert final["size"] == 2
    assert_reference_parameters(final)


@pytest.mark.parametrize("start,added,grown", [
    ("localhost:2", "127.0.0.1:2", 4),
    ("localhost:2", "127.0.0.1:1", 3),
], ids=["np2-to-4", "np2-to-3"])
def test_b_an_added_host_grows_the_job_from_the_committed_state(tmp_path, start, added, grown):
    script, listing = discovery_script(tmp_path, [start])
    proc, events = elastic_job(tmp_path, ["-np", "2", "--max-np", "4", "--host-discovery-script", script],
                               "train_torch.py",
                               env={"ELASTIC_ADD": "6:%s:%s" % (listing, added), "ELASTIC_GROW_TO": str(grown)})
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    final = final_of(events)
    assert final["size"] == grown
    assert_reference_parameters(final)
    # The newcomers started from what rank 0 held at the round's start.
    syncs = [e for w in events.values() for e in w if e["event"] == "sync" and e["size"] == grown]
    assert len(syncs) == grown, syncs
    leader = [e for e in syncs if e["rank"] == 0][0]
    assert leader["step"] > 6
    newcomers = [e for e in syncs if e["worker"].startswith("127.0.0.1")]
    assert len(newcomers) == grown - 2
    for e in newcomers:
        assert (e["step"], e["weight"]) == (leader["step"], leader["weight"])
        assert len([x for x in events[e["worker"]] if x["event"] == "sync"]) == 1


def test_elastic_sampler_shards_what_is_left_over_any_number_of_ranks():
    from unison.torch.elastic import ElasticSampler

    dataset = list(range(23))
    two = [ElasticSampler(dataset, seed=3) for _ in range(2)]
    for rank, sampler in enumerate(two):
        sampler.set_epoch(1)
        sampler._reshard(2, rank)
    batches = [list(s)[:8] for s in two]  # two batches of 4 on each rank
    for sampler in two:
        sampler.record_batch(0, 4)
        sampler.record_batch(1, 4)
    # Every rank recorded every rank's batches: their records agree.
    assert two[0].state_dict() == two[1].state_dict()
    assert set(two[0].processed_indices) == set(batches[0] + batches[1])
    three = [ElasticSampler(dataset, seed=3) for _ in range(3)]
    for rank, sampler in enumerate(three):
        sampler.load_state_dict(two[0].state_dict())
        sampler._reshard(3, rank)
    shards = [list(s) for s in three]
    assert len({len(s) for s in shards}) == 1  # as many steps on every rank
    left = set(dataset) - set(two[0].processed_indices)
    assert set().union(*shards) == left  # the rest of the epoch, nothing seen twice but padding
    assert sum(len(s) for s in shards) - len(left) < 3
    # The same epoch again keeps the progress; a new one starts afresh.
    three[0].set_epoch(1)
    assert three[0].processed_indices == set(two[0].processed_indices)
    three[0].set_epoch(2)
    assert three[0].processed_indices == set()
