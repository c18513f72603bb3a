"""What a benchmark run printed, kept as JSON: `--json PATH` on any script
here (`unisonrun -np 2 python benchmarks/allreduce.py --json out.json`)
writes, from rank 0 at its end, the machine, the date, the versions, the
command, every line the run printed and the Markdown tables among them,
parsed into rows.

benchmarks/render.py makes the docs' performance page and its plots from
the files committed under benchmarks/results/, so that what the page shows
is what a run printed, not figures typed from it.

Each script calls capture() before it parses its arguments. The path is
handed on in BENCHMARK_JSON, so a script that starts itself again (as
torch_train.py does, with glibc's heap kept) or ranks that a script starts
still know it; only rank 0 of a job writes."""
import atexit
import datetime
import importlib.util
import io
import json
import os
import platform
import re
import subprocess
import sys
import time

VARIABLE = "BENCHMARK_JSON"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_and_size():
    for rank, size in (("UNISON_RANK", "UNISON_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ.get(size, "1")), rank
    return 0, 1, None


class _Tee(io.TextIOBase):
    """The process's stdout, and a copy of what passes through it."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []
        self._partial = ""

    def write(self, text):
        self.stream.write(text)
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines += done
        return len(text)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()

    def fileno(self):
        return self.stream.fileno()


def capture():
    """Takes `--json PATH` out of sys.argv (so that the script's own parser
    never sees it) and, on rank 0, writes the run's record there at exit."""
    if "--json" in sys.argv:
        at = sys.argv.index("--json")
        if at + 1 >= len(sys.argv):
            raise SystemExit("--json needs a file name")
        os.environ[VARIABLE] = os.path.abspath(sys.argv[at + 1])
        del sys.argv[at:at + 2]
    path = os.environ.get(VARIABLE)
    rank, size, launcher = _rank_and_size()
    if not path or rank != 0:
        return
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    started = time.time()
    command = "python benchmarks/%s%s" % (os.path.basename(sys.argv[0]),
                                          "".join(" " + a for a in sys.argv[1:]))
    if launcher == "UNISON_RANK":
        command = "unisonrun -np %d %s" % (size, command)
    elif launcher is not None:
        command = "mpirun -np %d %s" % (size, command)

    def write():
        sys.stdout = tee.stream
        if tee._partial:
            tee.lines.append(tee._partial)
        record = {
            "benchmark": os.path.splitext(os.path.basename(sys.argv[0]))[0],
            "date": datetime.date.today().isoformat(),
            "command": command,
            "seconds": round(time.time() - started, 1),
            "machine": machine(),
            "versions": versions(),
            "lines": tee.lines,
            "tables": tables(tee.lines),
        }
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print("wrote %s" % path, file=sys.stderr, flush=True)
    # Registered now, so it runs after the script's own exit handlers (atexit
    # runs the last registered first), whatever they still print.
    atexit.register(write)


def tables(lines):
    """The Markdown tables among `lines`: each a header and its rows of cells."""
    found, current = [], None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            current = None
            continue
        if current is None:
            current = {"header": cells, "rows": []}
            found.append(current)
        elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
            current["rows"].append(cells)
    return found


def _memcpy_gbps():
    """Single-core copy speed, the figure runs on different machines are
    compared by: the best of five copies of 64 MiB."""
    import numpy as np
    a = np.ones(64 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        begun = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - begun)
    return round(a.nbytes / best / 1e9, 1)


def _python_loop_ns():
    """The interpreter's speed, as CI's summary measures it (.ci/summary.py's
    fixed loop, the same code so that the figures compare): a VM's Python
    can slow by half for minutes at unchanged memcpy, and a per-tensor
    figure in microseconds moves with it."""
    spec = importlib.util.spec_from_file_location("ci_summary", os.path.join(ROOT, ".ci", "summary.py"))
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    return round(summary.python_nanoseconds_an_iteration())


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M).group(1).strip()
    except (OSError, AttributeError):
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = round(int(re.search(r"MemTotal:\s*(\d+)", f.read()).group(1)) / (1 << 20))
    except (OSError, AttributeError):
        pass
    described = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "memcpy_gbps": _memcpy_gbps(),
                 "python_loop_ns": _python_loop_ns()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        described["gpu"] = torch.cuda.get_device_name(0)
    return described


def versions():
    found = {"python": platform.python_version()}
    try:
        found["unison"] = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         timeout=10).stdout.decode().strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    for name in ("numpy", "torch", "tensorflow", "mxnet", "mpi4py"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = getattr(module, "__version__", None)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        found["mpi"] = " ".join(mpi.Get_library_version().split("\n")[0].split())
    return found
