"""Elastic Keras (model.fit with KerasState and the elastic callbacks), a
TensorFlow custom loop (TensorFlowKerasState, DistributedGradientTape in a
tf.function, with and without XLA), a TF1 session (TensorFlowState(session=...)) and MXNet Gluon (MXNetState over a DistributedTrainer) under the elastic
launcher with two simulated hosts: a worker dies mid-step and the job
finishes on the rest; a host appears and the job grows. The final
parameters are those of one process on the same committed steps
(tests/elastic/reference.py). Each framework's tox env runs its cases
(-k keras, -k tensorflow, -k mxnet); torch has its own, larger file."""
import importlib.util
import os
import sys

import pytest

from jobs import HERE, discovery_script, elastic_job

sys.path.insert(0, os.path.join(HERE, "elastic"))
import reference  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# framework: (the module it needs, its job, its reference, the growth case:
# the first host's slots, the added host's slots[, the job's environment])
FRAMEWORKS = {
    "keras": ("tensorflow", "train_keras.py", "keras_reference", 2, 1),
    # A custom loop whose tf.function is traced in a job of one, then grows.
    "tensorflow": ("tensorflow", "train_tensorflow.py", "keras_reference", 1, 2),
    # The same loop compiled by XLA, its allreduce a custom call of the XLA
    # program: a lost rank fails the program with TensorFlow's Aborted, which
    # hvd.elastic.run must take for a reset.
    "tensorflow-xla": ("tensorflow", "train_tensorflow.py", "keras_reference", 1, 2, {"TRAIN_JIT_COMPILE": "1"}),
    "mxnet": ("mxnet", "train_mxnet.py", "mxnet_reference", 1, 2),  # grows from a job of one
    # A TF1 graph and session, built in a job of one, then grown.
    "tensorflow-session": ("tensorflow", "train_tf1_session.py", "keras_reference", 1, 2),
}


def job_of(framework):
    module, script, reference_name, first, added, *env = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip("%s is not installed here; its tox env runs this" % module)
    return script, getattr(reference, reference_name), first, added, dict(*env)


def check_final(events, size, expected):
    finals = [e for worker in events.values() for e in worker if e["event"] == "final"]
    assert len(finals) == 1 and finals[0]["size"] == size and finals[0]["step"] == reference.STEPS, finals
    for name, values in expected(reference.STEPS).items():
        assert finals[0]["params"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_job_survives_a_killed_worker(tmp_path, framework):
    script, expected, _, _, env = job_of(framework)
    proc, events = elastic_job(tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1"], script,
                               env=dict(env, ELASTIC_FAULT="127.0.0.1:0@9:sigkill"))
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    check_final(events, 2, expected)
    resumed = [e for w in events.values() for e in w if e["event"] == "sync" and e["size"] == 2]
    # From the last commit (step 9's, or 10's when step 9 completed before
    # the victim died), the same on every survivor.
    assert len({e["step"] for e in resumed}) == 1 and resumed[0]["step"] in (9, 10), resumed


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_job_grows_when_a_host_is_added(tmp_path, framework):
    script, expected, first, added, env = job_of(framework)
    grown = first + added
    listing_script, listing = discovery_script(tmp_path, ["localhost:%d" % first])
    proc, events = elastic_job(tmp_path, ["-np", str(first), "--max-np", "3", "--host-discovery-script",
                                          listing_script], script,
                               env=dict(env, ELASTIC_ADD="5:%s:127.0.0.1:%d" % (listing, added),
                                        ELASTIC_GROW_TO=str(grown)))
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    check_final(events, grown, expected)
    for slot in range(added):  # each newcomer synced once, from the committed state
        synced = [e for e in events["127.0.0.1:%d" % slot] if e["event"] == "sync"]
        assert len(synced) == 1 and synced[0]["step"] > 5, synced
