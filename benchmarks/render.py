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
    ("threads", "Blocking collectives from several threads of a rank", r"^$^"),
    ("poll", "Polling an asynchronous op until it is done", r"^$^"),
    ("heap_trim", "CPU training and glibc's heap", r"^$^"),
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


def machine_words(machine):
    words = "%s, %d cores, %s GiB" % (machine["cpu"], machine["cores"], machine["memory_gib"])
    if machine.get("gpu"):
        words = machine["gpu"] + "; " + words
    return words + "; single-core memcpy %.1f GB/s" % machine["memcpy_gbps"]


def latest_per_machine(recorded):
    latest = {}
    for run in recorded:
        m = run["machine"]
        latest[(m["cpu"], m["cores"], m.get("gpu"), run["command"].split(" python ")[0])] = run
    return sorted(latest.values(), key=lambda run: run["command"])


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
        for run in latest_per_machine(runs[benchmark]):
            parts += ["`%s` on %s, %s (%s; `%s`):" % (run["command"], run["date"], machine_words(run["machine"]),
                                                  versions_words(run["versions"]), run["file"]), ""]
            for table in run["tables"]:
                parts += [table_markdown(table), ""]
            said = [line.strip() for line in run["lines"] if re.search(notable, line)]
            if said:
                parts += ["```text"] + said + ["```", ""]
    parts.append(END)
    return "\n".join(parts) + "\n"


def _value(cell):
    """A table cell's number in base units: '6.2 us' -> 6.2e-6, '1.32 ms (12.7 GB/s)' -> 1.32e-3."""
    match = re.match(r"([\d.,]+)\s*(us|ms|s)?\b", cell)
    if not match:
        return None
    number = float(match.group(1).replace(",", ""))
    return number * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[match.group(2)]


def plot_allreduce(run, path, plt):
    table = run["tables"][0]
    libraries = [h[:-len(" latency")] for h in table["header"] if h.endswith(" latency")]
    sizes = [row[0] for row in table["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for index, (library, marker) in enumerate(zip(libraries, "osd^")):
        ax.plot(range(len(sizes)), [_value(row[1 + index]) * 1e6 for row in table["rows"]], marker=marker,
                label=library)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("allreduce size (float32, in place, Sum)")
    ax.set_ylabel("latency per allreduce (us, log scale)")
    ax.set_title("Allreduce latency, %s\n%s, %s" % (run["command"].split(" python ")[0].replace("mpirun", "")
                                                    .replace("unisonrun", "").strip().replace("-np ", "")
                                                    + " ranks on one host", run["machine"]["cpu"], run["date"]),
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_torch_train(runs, path, plt):
    rows = []
    for run in runs:
        ranks = re.search(r"-np (\d+)", run["command"]).group(1)
        for row in run["tables"][0]["rows"]:
            if row[0].startswith(("unison DistributedOptimizer", "DDP", "%s independent" % ranks)):
                rows.append(("%s ranks: %s" % (ranks, row[0].replace(" (the ceiling)", "")), _value(row[1])))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [value for _, value in rows], color=["C0", "C1", "C2"] * len(rows))
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (higher is better)")
    ax.set_title("Training the MLP of benchmarks/torch_train.py, %s" % runs[0]["machine"]["cpu"], fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {
    "allreduce": lambda runs, path, plt: plot_allreduce(runs[-1], path, plt),
    "torch_train": plot_torch_train,
}


def plot(runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(IMAGES, exist_ok=True)
    for benchmark, draw in PLOTS.items():
        if benchmark in runs:
            chosen = latest_per_machine(runs[benchmark])
            path = os.path.join(IMAGES, benchmark + ".png")
            draw(chosen, path, plt)
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
