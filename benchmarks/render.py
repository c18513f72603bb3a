"""Makes the docs' performance page (docs/performance.md, between its
`<!-- results -->` markers) and its plots (docs/img/) from the runs
recorded under benchmarks/results/ (results.py: each benchmark's `--json`).

    python benchmarks/render.py            # rewrite the page's tables and the plots
    python benchmarks/render.py --check    # exit 1 if the page's tables are not what the results give

For each benchmark it shows the latest run on each machine, with the
command, date, machine and versions, and the tables that run printed, as it
printed them. tests/test_docs.py runs the check, so a page cannot show
figures that no committed run printed."""
import argparse
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(ROOT, "docs", "performance.md")
IMAGES = os.path.join(ROOT, "docs", "img")
BEGIN, END = "<!-- results: made by benchmarks/render.py from benchmarks/results/ -->", "<!-- end of results -->"

# The benchmarks the page shows, in its order, with what each compares and
# which of its printed lines (beyond its tables) say something a table does not.
SHOWN = [
    ("allreduce", "Allreduce latency and bandwidth: unison, `torch.distributed` (gloo) and MPICH",
     r"^(200 x 40 KB|  of which|  the same 200|  starting|allreduce of float32|single-core memcpy|  \S.*: .*(met|MISSED))"),
    ("torch_train", "Training throughput: `DistributedOptimizer` against DDP and independent processes",
     r"^(MLP |the floor is|target:)"),
    ("threads", "Blocking collectives from several threads of a rank", r"."),
    ("poll", "Polling an asynchronous op until it is done", r"."),
    ("heap_trim", "CPU training and glibc's heap", r"^(MLP |unison / independent)"),
    ("tf_op_path", "TensorFlow's op path: an allreduce eagerly, in a `tf.function`, a TF1 session and under XLA",
     r"^(float32 allreduce|a tf\.function step)"),
]


def load():
    """Every recorded run, by benchmark, oldest first."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            run = json.load(f)
        run["file"] = os.path.relpath(path, ROOT)
        runs.setdefault(run["benchmark"], []).append(run)
    for recorded in runs.values():
        recorded.sort(key=lambda run: (run["date"], run["file"]))
    return runs


def machine_words_of(runs):
    machine = runs[-1]["machine"]
    words = "%s, %d cores, %s GiB" % (machine["cpu"], machine["cores"], machine["memory_gib"])
    if machine.get("gpu"):
        words = machine["gpu"] + "; " + words
    def span(values, form):
        values = sorted(values)
        return form % values[0] if values[0] == values[-1] else (form + "-" + form) % (values[0], values[-1])
    words += "; single-core memcpy %s GB/s" % span([run["machine"]["memcpy_gbps"] for run in runs], "%.1f")
    # Runs recorded since 2026-12-07 also give the Python speed CI's summary gives.
    if all("python_loop_ns" in run["machine"] for run in runs):
        words += ", Python loop iteration %s ns" % span([run["machine"]["python_loop_ns"] for run in runs], "%d")
    return words


def machine_key(run):
    m = run["machine"]
    return m["cpu"], m["cores"], m.get("gpu"), run["command"]


def latest_per_machine(recorded):
    """For each machine and command, the runs of the latest day it was run."""
    groups = {}
    for run in recorded:
        groups.setdefault(machine_key(run), []).append(run)
    chosen = []
    for runs in groups.values():
        last = max(run["date"] for run in runs)
        chosen.append([run for run in runs if run["date"] == last])
    return sorted(chosen, key=lambda runs: runs[0]["command"])


_CELL = re.compile(r"^(-?[\d.,]+)( ?)([a-zA-Z/%]*)$")


def _merged_cell(cells):
    """One cell for several runs' cells: the range of their numbers where
    they share a unit ("5.3-9.3 us"), else the cells as printed, one per run."""
    if len(set(cells)) == 1:
        return cells[0]
    parsed = [_CELL.match(c) for c in cells]
    if all(parsed) and len({(m.group(2), m.group(3)) for m in parsed}) == 1:
        values = sorted(parsed, key=lambda m: float(m.group(1).replace(",", "")))
        return "%s-%s%s%s" % (values[0].group(1), values[-1].group(1), parsed[0].group(2), parsed[0].group(3))
    return " / ".join(cells)


def merged_tables(runs):
    """The runs' tables as one: each cell the range over the runs (their
    tables must match in header and first column, as runs of one command do)."""
    tables = []
    for index, table in enumerate(runs[0]["tables"]):
        same = [run["tables"][index] for run in runs if len(run["tables"]) > index
                and run["tables"][index]["header"] == table["header"]
                and [row[0] for row in run["tables"][index]["rows"]] == [row[0] for row in table["rows"]]]
        if len(same) < len(runs):  # a run printed something else: show the first run's as it printed it
            same = [table]
        rows = [[row[0]] + [_merged_cell([t["rows"][r][c] for t in same]) for c in range(1, len(row))]
                for r, row in enumerate(table["rows"])]
        tables.append({"header": table["header"], "rows": rows})
    return tables


def versions_words(versions):
    return ", ".join("%s %s" % (name, value) for name, value in versions.items() if value and name != "mpi") + (
        "; %s" % versions["mpi"] if versions.get("mpi") else "")


def table_markdown(table):
    lines = ["| " + " | ".join(table["header"]) + " |", "|" + " --- |" * len(table["header"])]
    lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return "\n".join(lines)


def markdown():
    """The page's generated part."""
    runs = load()
    parts = [BEGIN, ""]
    for benchmark, title, notable in SHOWN:
        if benchmark not in runs:
            continue
        parts += ["## %s" % title, ""]
        if benchmark in PLOTS:
            parts += ["![%s](img/%s.png)" % (title.replace("`", ""), benchmark), ""]
        for day in latest_per_machine(runs[benchmark]):
            run = day[-1]
            files = ", ".join("`%s`" % r["file"] for r in day)
            parts += ["`%s` on %s, %s (%s; %s%s):" % (
                run["command"], run["date"], machine_words_of(day), versions_words(run["versions"]),
                "%d runs, each cell the range over them: " % len(day) if len(day) > 1 else "", files), ""]
            for table in merged_tables(day):
                parts += [table_markdown(table), ""]
            said = [line.rstrip() for line in run["lines"] if re.search(notable, line)]
            if said:
                parts += ["The last run also printed:" if len(day) > 1 else "It also printed:", "", "```text"]
                parts += said + ["```", ""]
    parts.append(END)
    return "\n".join(parts) + "\n"


def _value(cell):
    """A table cell's number in base units: '6.2 us' -> 6.2e-6, '1.32 ms (12.7 GB/s)' -> 1.32e-3."""
    match = re.match(r"([\d.,]+)\s*(us|ms|s)?\b", cell)
    if not match:
        return None
    number = float(match.group(1).replace(",", ""))
    return number * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[match.group(2)]


def _spread(values):
    """The median of `values` and its distance to their least and greatest, for an error bar."""
    values = sorted(values)
    middle = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return middle, middle - values[0], values[-1] - middle


def _ranks(command):
    return int(re.search(r"-np (\d+)", command).group(1))


def plot_allreduce(groups, path, plt):
    day = max(groups, key=lambda runs: ("MPICH" in " ".join(runs[0]["tables"][0]["header"]), len(runs)))
    table = day[0]["tables"][0]
    libraries = [h[:-len(" latency")] for h in table["header"] if h.endswith(" latency")]
    sizes = [row[0] for row in table["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for index, (library, marker) in enumerate(zip(libraries, "osd^")):
        points = [_spread([_value(run["tables"][0]["rows"][r][1 + index]) * 1e6 for run in day])
                  for r in range(len(sizes))]
        ax.errorbar(range(len(sizes)), [p[0] for p in points], yerr=[[p[1] for p in points], [p[2] for p in points]],
                    marker=marker, capsize=3, label=library)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("allreduce size (float32, in place, Sum)")
    ax.set_ylabel("latency per allreduce (us, log scale)")
    ax.set_title("Allreduce latency, %d ranks on one host (%s, %s)\nmedian and range of %d runs"
                 % (_ranks(day[0]["command"]), day[0]["machine"]["cpu"], day[0]["date"], len(day)), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


TRAINERS = [("unison DistributedOptimizer", "unison DistributedOptimizer"), ("DDP (gloo)", "DDP over gloo"),
            ("independent processes (the ceiling)", "independent processes (the ceiling)")]


def plot_torch_train(groups, path, plt):
    groups = sorted(groups, key=lambda runs: _ranks(runs[0]["command"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(TRAINERS)
    for index, (row_name, label) in enumerate(TRAINERS):
        points = []
        for day in groups:
            values = [_value(row[1]) for run in day for row in run["tables"][0]["rows"] if row_name in row[0]]
            points.append(_spread(values))
        positions = [g + (index - (len(TRAINERS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(positions, [p[0] for p in points], width, yerr=[[p[1] for p in points], [p[2] for p in points]],
               capsize=3, label=label)
    ax.set_xticks(range(len(groups)), ["%d ranks (%d runs)" % (_ranks(day[0]["command"]), len(day)) for day in groups])
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_title("Training the 10-layer MLP of benchmarks/torch_train.py (%s, %s)\nmedian and range of the runs"
                 % (groups[0][0]["machine"]["cpu"], groups[0][0]["date"]), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(TRAINERS), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {"allreduce": plot_allreduce, "torch_train": plot_torch_train}


def plot(runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(IMAGES, exist_ok=True)
    for benchmark, draw in PLOTS.items():
        if benchmark in runs:
            path = os.path.join(IMAGES, benchmark + ".png")
            draw(latest_per_machine(runs[benchmark]), path, plt)
            print("wrote", os.path.relpath(path, ROOT))


def page_with(generated, page):
    begin, end = page.index(BEGIN), page.index(END) + len(END) + 1
    return page[:begin] + generated + page[end:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the page shows what the results give")
    args = parser.parse_args()
    with open(PAGE) as f:
        page = f.read()
    wanted = page_with(markdown(), page)
    if args.check:
        if wanted != page:
            sys.exit("docs/performance.md differs from what benchmarks/results/ gives: run python benchmarks/render.py")
        return
    with open(PAGE, "w") as f:
        f.write(wanted)
    print("wrote", os.path.relpath(PAGE, ROOT))
    plot(load())


if __name__ == "__main__":
    main()
