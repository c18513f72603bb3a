"""unison.ray on a local Ray cluster (ray.init(num_cpus=4)): RayExecutor's
every method at 2 and 4 workers, training that ends with one process's
parameters, an elastic job that loses an actor, and Ray Train's
UnisonTrainer. test_ray_nodes.py runs jobs across two Ray nodes."""
import json
import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from unison.ray import RayExecutor, UnisonTrainer, workers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
import engine_work  # noqa: E402
from engine_work import STEPS, assert_reference_parameters  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One Ray instance for the module: starting one takes seconds. Its
    actors import tests/engine_work.py, as Ray pickles its functions by name."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def settings():
    return RayExecutor.create_settings(timeout_s=60)


def assert_collectives(results, n, scale):
    everyone = [scale * (r + 1) for r in range(n)]
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert r["size"] == n and r["local_size"] == n and r["local_rank"] == r["rank"]
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["sum"] == [sum(everyone)] * 3
        assert r["gathered"] == [v + i for q, v in enumerate(everyone) for i in range(q + 1)]
        assert r["from_last"] == [everyone[-1]] * 3
    assert len({r["pid"] for r in results}) == n  # one actor process per rank


@pytest.mark.parametrize("n", [2, 4])
def test_every_method_of_the_executor(n):
    executor = RayExecutor(settings(), num_workers=n, cpus_per_worker=1)
    executor.start(executable_cls=engine_work.Executable, executable_args=[100], executable_kwargs={"times": 10},
                   extra_env_vars={"ENGINE_TEST_EXTRA": "seen"})
    try:
        # execute: fn(executable) on every rank, in rank order.
        assert executor.execute(lambda executable: executable.value()) == [100 + 10 * r for r in range(n)]
        assert executor.execute_single(lambda executable: (executable.rank, executable.value())) == (0, 100)
        results = executor.run(engine_work.collectives, args=[2.0])
        assert_collectives(results, n, 2.0)
        assert {r["extra"] for r in results} == {"seen"}
        refs = executor.run_remote(engine_work.collectives, kwargs={"scale": 3.0})
        assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
        assert_collectives(ray.get(refs), n, 3.0)
        # The same actors, one call after another.
        assert [r["pid"] for r in executor.run(engine_work.collectives, args=[1.0])] == [r["pid"] for r in results]
    finally:
        executor.shutdown()
    assert executor.workers == []
    with pytest.raises(RuntimeError, match="start"):
        executor.run(engine_work.collectives, args=[1.0])


@pytest.mark.parametrize("n", [2, 3])
def test_training_ends_with_the_parameters_of_one_process(n):
    executor = RayExecutor(settings(), num_workers=n)
    executor.start()
    try:
        results = executor.run(engine_work.train)
    finally:
        executor.shutdown()
    assert [r["rank"] for r in results] == list(range(n)) and {r["size"] for r in results} == {n}
    for r in results:
        assert_reference_parameters(r["params"])


def test_a_failing_rank_fails_the_run_and_the_executor_runs_on():
    """The rank's own error, not its peers' (they fail because it left),
    and at once: the peers would otherwise wait in their allreduce."""
    executor = RayExecutor(settings(), num_workers=3)
    executor.start()
    try:
        with pytest.raises(ValueError, match="rank 1 fails on purpose") as raised:
            executor.run(engine_work.fails_on, args=[1])
        assert "unison.ray: rank 1 of 3 failed; ranks [0, 2] failed after losing it" in raised.value.__notes__
        refs = executor.run_remote(engine_work.fails_on, args=[1])
        for rank, ref in enumerate(refs):
            with pytest.raises(Exception, match="rank 1 fails on purpose" if rank == 1 else "rank 1 has shut down"):
                ray.get(ref)
        assert_collectives(executor.run(engine_work.collectives, args=[1.0]), 3, 1.0)
    finally:
        executor.shutdown()


def test_an_elastic_job_loses_an_actor_and_ends_with_the_parameters_of_one_process(tmp_path):
    """The last of 3 ranks kills its own actor at step 9; the others roll
    back to their last commit. Ray's one node is blacklisted for the
    cooldown (a failed worker's host is, under unisonrun too), then a new
    actor takes the lost one's place."""
    executor = RayExecutor(settings(), num_workers=3, min_workers=2, max_workers=3, cooldown_range=(1, 2))
    executor.start()
    try:
        results = executor.run(engine_work.elastic_train, args=[str(tmp_path / "victim")])
    finally:
        executor.shutdown()
    assert (tmp_path / "victim").exists()
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["step"] == STEPS and r["size"] == 3
        assert_reference_parameters(r["params"])
    survivors = [r for r in results if len(r["rounds"]) == 2]
    assert len(survivors) == 2, results  # the newcomer joined in the second round only
    assert {r["rounds"][1][1] for r in survivors} <= {9, 10}  # resumed from the last commit


def test_an_elastic_job_that_cannot_go_on_fails_with_the_reason(tmp_path):
    executor = RayExecutor(settings(), num_workers=2, min_workers=2, max_workers=2, reset_limit=0,
                           cooldown_range=(1, 1))
    executor.start()
    with pytest.raises(NotImplementedError, match="run"):
        executor.execute(lambda executable: None)
    try:
        with pytest.raises(RuntimeError, match="reset-limit 0"):
            executor.run(engine_work.elastic_train, args=[str(tmp_path / "victim")], kwargs={"victim_step": 3})
    finally:
        executor.shutdown()


def test_ray_train_runs_a_unison_job(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    trainer = UnisonTrainer(engine_work.train_loop_for_ray_train, train_loop_config={"folder": str(folder)},
                            scaling_config=ray.train.ScalingConfig(num_workers=3),
                            run_config=ray.train.RunConfig(storage_path=str(tmp_path / "storage"), name="unison"))
    result = trainer.fit()
    assert result.error is None
    results = [json.loads((folder / ("worker%d.json" % r)).read_text()) for r in range(3)]
    for r in results:
        # unison's ranks are Ray Train's.
        assert r["rank"] == r["world_rank"] and r["local_rank"] == r["ray_local_rank"]
        assert r["size"] == r["world_size"] == 3
        assert_reference_parameters(r["params"])


def test_ranks_are_numbered_node_by_node_and_a_node_shares_its_gpus():
    """job_environments, from places as Ray reports them: what makes actors a
    job, on places no test machine has."""
    a = {"node": "a" * 56, "address": "10.0.0.1", "gpus": ["0"]}
    b = {"node": "b" * 56, "address": "10.0.0.2", "gpus": ["3"]}
    a2, b2 = dict(a, gpus=["1"]), dict(b, gpus=["2"])
    places = [a, b, a2, b2]
    order = workers.in_node_order(places)
    assert order == [0, 2, 1, 3]
    envs, job_id = workers.job_environments([places[i] for i in order], rendezvous_port=29500, timeout_s=30)
    assert [e["UNISON_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [(e["UNISON_LOCAL_RANK"], e["UNISON_CROSS_RANK"]) for e in envs] == [
        ("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "3,2", "3,2"]
    assert {e["UNISON_RENDEZVOUS_ADDR"] for e in envs} == {"10.0.0.1"}
    assert {e["UNISON_RENDEZVOUS_PORT"] for e in envs} == {"29500"}
    assert len({e["UNISON_SECRET_KEY"] for e in envs}) == 1 and len(envs[0]["UNISON_SECRET_KEY"]) == 64
    assert {e["UNISON_JOB_ID"] for e in envs} == {job_id} and {e["UNISON_START_TIMEOUT"] for e in envs} == {"30"}
    assert envs[0]["HOROVOD_RANK"] == "0" and envs[3]["HOROVOD_LOCAL_RANK"] == "1"
    # One node: shared memory only, no rendezvous and no secret.
    alone, _ = workers.job_environments([a, a2])
    assert not any(k.startswith(("UNISON_RENDEZVOUS", "UNISON_SECRET")) for e in alone for k in e)
    with pytest.raises(ValueError, match="one network interface"):
        RayExecutor.create_settings(timeout_s=30, nics={"eth0", "eth1"})
    with pytest.raises(ValueError, match="num_workers"):
        RayExecutor(settings())
