"""Autotune under the launcher, at 2 and 3 ranks (and 4 on two hosts, where
the hierarchical layout is searched too): the search ends on one
setting, the same on every rank, within the warm-up steps; its CSV log
holds every setting tried with its score and the choice; a setting the
user fixed is not searched. With numpy here, and with torch training (the
torch env runs that one)."""
import csv
import sys

import pytest

from jobs import unisonrun

pytestmark = pytest.mark.timeout(300)
# Short samples. The cache is searched too, so switching it is tested for
# every rank ending on the same setting.
QUICK = {"UNISON_AUTOTUNE_STEPS_PER_SAMPLE": "2", "UNISON_AUTOTUNE_SAMPLES": "1"}

# Steps of 8 gradients until the autotuner settles; every rank prints what
# it ended with and whether all ranks agree. Whether to stop is rank 0's
# answer, broadcast: ranks read their settings at different moments, and
# a loop that ends on one rank before another would leave that one waiting.
NUMPY_STEPS = """
import numpy as np, unison, unison.numpy as unp
unison.init()
grads = [np.ones(20000 + 1000 * i, np.float32) for i in range(8)]
for step in range(400):
    handles = [unp.allreduce_async(g, name="grad.%d" % i) for i, g in enumerate(grads)]
    for h in handles:
        unp.synchronize(h)
    s = unison.basics.tuned_settings()
    if unp.broadcast(np.array([s["settled"]]), 0, name="settled")[0]:
        s = unison.basics.tuned_settings()
        break
"""

TORCH_STEPS = """
import torch, unison, unison.torch as hvd
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
for step in range(400):
    optimizer.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    s = unison.basics.tuned_settings()
    if hvd.broadcast_object(s["settled"], 0, name="settled"):
        s = unison.basics.tuned_settings()
        break
"""

REPORT = """
import numpy as np
import unison.numpy as unp
row = np.array([[s["fusion_threshold_bytes"], s["cycle_time_ms"], s["cache"], s["hierarchical"]]], np.float64)
everyone = unp.allgather(row, name="autotune.report")
print("rank %d settled %s at step %d: %s; every rank the same: %s" % (
    unison.rank(), s["settled"], step, row.tolist(), bool((everyone == everyone[0]).all())))
"""


def run(tmp_path, np_, body, options=(), env=None):
    script = tmp_path / "steps.py"
    script.write_text(body + REPORT)
    log = tmp_path / "autotune.csv"
    proc = unisonrun(["-np", str(np_), "--autotune", "--autotune-log-file", str(log)] + list(options),
                     [sys.executable, str(script)], env=dict(QUICK, **(env or {})), timeout=240)
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    reports = [line for line in output.splitlines() if "settled" in line]
    assert len(reports) == np_, output[-3000:]
    for line in reports:
        assert "settled True" in line and "every rank the same: True" in line, line
    with open(log) as f:
        rows = list(csv.DictReader(f))
    return rows, reports


def check_log(rows):
    assert rows[-1]["note"] == "chosen", rows
    samples = [r for r in rows if r["note"] == "sample"]
    assert len(samples) >= 2 and all(float(r["bytes_per_second"]) > 0 for r in samples), rows
    return samples


@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_steps_settle_on_one_setting(tmp_path, np_):
    rows, reports = run(tmp_path, np_, NUMPY_STEPS)
    samples = check_log(rows)
    # Every candidate of the searched settings was tried.
    assert {int(r["fusion_threshold_bytes"]) >> 20 for r in samples} == {1, 4, 16, 64, 128}
    assert {float(r["cycle_time_ms"]) for r in samples} == {0, 1, 2.5, 5}
    assert {r["cache"] for r in samples} == {"0", "1"}
    chosen = rows[-1]
    assert "[[%s.0, %s" % (chosen["fusion_threshold_bytes"], float(chosen["cycle_time_ms"])) in reports[0], reports


def test_across_two_hosts_the_hierarchical_layout_is_searched_too(tmp_path):
    rows, _ = run(tmp_path, 4, NUMPY_STEPS, options=["-H", "localhost:2,127.0.0.1:2"])
    samples = check_log(rows)
    assert {r["hierarchical"] for r in samples} == {"0", "1"}


def test_a_setting_the_user_fixed_is_not_searched(tmp_path):
    rows, reports = run(tmp_path, 2, NUMPY_STEPS, options=["--fusion-threshold-mb", "8"])
    samples = check_log(rows)
    assert {int(r["fusion_threshold_bytes"]) for r in rows} == {8 << 20}
    assert len({float(r["cycle_time_ms"]) for r in samples}) == 4
    assert all("[[8388608.0," in line for line in reports), reports


def test_the_cache_can_be_left_out_of_the_search(tmp_path):
    rows, _ = run(tmp_path, 2, NUMPY_STEPS, env={"UNISON_AUTOTUNE_CACHE": "0"})
    assert {r["cache"] for r in check_log(rows)} == {"1"}


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_training_settles_on_one_setting(tmp_path, np_):
    pytest.importorskip("torch")
    rows, _ = run(tmp_path, np_, TORCH_STEPS)
    check_log(rows)


def test_autotune_settings_are_checked():
    proc = unisonrun(["-np", "2", "--autotune-log-file", "x.csv"], ["true"], timeout=60)
    assert proc.returncode == 2 and "--autotune-log-file x.csv needs --autotune" in proc.stdout.decode()
    proc = unisonrun(["-np", "1"], [sys.executable, "-c", "import unison; unison.init()"],
                     env={"UNISON_AUTOTUNE": "maybe"}, timeout=60)
    # Refused by the launcher, through the core's parser, before any rank starts.
    assert proc.returncode == 2 and proc.stdout.decode().endswith(
        "unisonrun: error: UNISON_AUTOTUNE='maybe' is not a flag (1, 0, true, false, yes, no, on or off)\n"), \
        proc.stdout.decode()
