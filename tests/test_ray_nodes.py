"""unison.ray across two Ray nodes on this machine (ray.cluster_utils.Cluster:
two raylets, each a unison host): ranks meet over the TCP plane with the
job's secret, and an elastic job shrinks when a node leaves and grows when
one joins."""
import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
from ray.cluster_utils import Cluster  # noqa: E402

from unison.ray import RayExecutor  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
import engine_work  # noqa: E402
from engine_work import STEPS, assert_reference_parameters  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}})
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_job_across_two_nodes(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=2)
    executor.start()
    try:
        results = executor.run(engine_work.collectives, args=[1.5])
        trained = executor.run(engine_work.train)
    finally:
        executor.shutdown()
    everyone = [1.5 * (r + 1) for r in range(4)]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    hosts = [r["host"] for r in results]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert [(r["local_rank"], r["cross_rank"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for r in results:
        assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2)
        assert r["sum"] == [sum(everyone)] * 3
        assert r["gathered"] == [v + i for q, v in enumerate(everyone) for i in range(q + 1)]
        assert r["from_last"] == [everyone[-1]] * 3
    for r in trained:
        assert_reference_parameters(r["params"])


def test_an_elastic_job_shrinks_when_a_node_leaves_and_grows_when_one_joins(cluster, tmp_path):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4, min_workers=2,
                           max_workers=4)
    executor.start()
    outcome = {}

    def run():
        try:
            outcome["results"] = executor.run(engine_work.elastic_train_as_nodes_change, args=[str(tmp_path)])
        except BaseException as e:  # noqa: B036 (reported below)
            outcome["error"] = e

    runner = threading.Thread(target=run)
    runner.start()
    try:
        def wait_for(name):
            while not (tmp_path / name).exists():
                assert runner.is_alive(), outcome
                time.sleep(0.1)
        wait_for("lose")
        leaving = [n for n in cluster.worker_nodes][0]
        cluster.remove_node(leaving)
        wait_for("grow")
        cluster.add_node(num_cpus=2)
        runner.join(timeout=240)
    finally:
        executor.shutdown()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert len({r["host"] for r in results}) == 2
    for r in results:
        assert r["step"] == STEPS and r["size"] == 4
        assert_reference_parameters(r["params"])
    # Two of the first four saw all three rounds: 4 ranks, then 2, then 4.
    survivors = [r for r in results if len(r["rounds"]) == 3]
    assert len(survivors) == 2, results
    assert [size for size, _ in survivors[0]["rounds"]] == [4, 2, 4]
