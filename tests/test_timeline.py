"""The timeline through the launcher: --timeline-filename and
--timeline-mark-cycles reach rank 0, and a job killed mid-run leaves a
trace that reads as far as it goes (no closing bracket, as Chrome's reader
accepts), which python -m unison.timeline summarises."""
import json
import signal
import subprocess
import sys

import pytest

from jobs import unisonrun
from unison import timeline

# Ranks allreduce named tensors; rank 0 kills itself once the writer has
# flushed some steps (it writes every 100 ms).
KILLED_MID_RUN = """
import os, signal, time, numpy as np, unison, unison.numpy as unp
unison.init()
for step in range(1000):
    unp.allreduce(np.ones(1000), name="step.grad")
    if unison.rank() == 0 and step == 20:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.01)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_killed_job_leaves_a_readable_trace(tmp_path, np_):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_RUN)
    trace = tmp_path / "t.json"
    proc = unisonrun(["-np", str(np_), "--timeline-filename", str(trace), "--timeline-mark-cycles"],
                     [sys.executable, str(script)], timeout=100)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout.decode()[-3000:]
    text = trace.read_text()
    assert text.startswith("[\n") and not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = timeline.load(str(trace))
    spans = timeline.spans(events)
    steps = [s for s in spans if s[0] == "step.grad" and s[1] == "SHM_ALLREDUCE"]
    assert len(steps) >= 20, len(steps)
    assert any(e["name"] == "CYCLE_START" for e in events)
    summary = subprocess.run([sys.executable, "-m", "unison.timeline", str(trace)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=60)
    output = summary.stdout.decode()
    assert summary.returncode == 0 and "step.grad" in output and "SHM_ALLREDUCE" in output, output


def test_a_timeline_that_cannot_be_written_is_reported_and_the_job_runs(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import numpy as np, unison, unison.numpy as unp\nunison.init()\n"
                      "print('sum', unp.allreduce(np.ones(2), op=unison.Sum, name='x').tolist())\n")
    proc = unisonrun(["-np", "2"], [sys.executable, str(script)], env={"UNISON_TIMELINE": "/nonexistent/t.json"},
                     timeout=60)
    output = proc.stdout.decode()
    assert proc.returncode == 0, output
    assert "cannot write the timeline to '/nonexistent/t.json'" in output and "(UNISON_TIMELINE)" in output
    assert output.count("sum [2.0, 2.0]") == 2
