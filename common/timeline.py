"""Reads a unison timeline (native/timeline.h) and prints where the time went.

    python -m unison.timeline t.json [--top 20]

For people who would rather read numbers than open Perfetto: the time each
tensor spent in each phase (summed over its steps), the totals per phase,
and the ranks the negotiations waited for most. A file whose job was killed
(no closing bracket, perhaps a half-written last event) reads as far as it
goes, as Chrome's reader does.
"""
import argparse
import collections
import json
import sys


def load(path):
    """The trace's events, from a whole file or from the complete events of
    one cut short."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    # Cut short: keep every line up to the last that parses as an event.
    events = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if line in ("[", "]", ""):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def spans(events):
    """(row name, phase, start us, duration us, begin args + end args) per
    finished span; begin and end pair up per row, innermost first."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    open_spans = collections.defaultdict(list)
    done = []
    for e in events:
        if e.get("ph") == "B":
            open_spans[e["tid"]].append(e)
        elif e.get("ph") == "E" and open_spans[e["tid"]]:
            begin = open_spans[e["tid"]].pop()
            args = dict(begin.get("args", {}), **e.get("args", {}))
            done.append((names.get(e["tid"], str(e["tid"])), begin["name"], begin["ts"], e["ts"] - begin["ts"], args))
    return done


def summarize(events, top=20):
    lines = []
    finished = spans(events)
    tensors = [s for s in finished if not s[0].startswith("group ")]
    by_tensor = collections.defaultdict(lambda: collections.defaultdict(float))
    for row, phase, _, duration, _ in tensors:
        by_tensor[row][phase] += duration
    first = ("QUEUED", "WAIT_FOR_DATA", "NEGOTIATE")
    phases = sorted({phase for _, phase, _, _, _ in tensors}, key=lambda p: (p not in first, p))
    lines.append("Time per tensor and phase, ms (summed over its steps; the %d busiest):" % min(top, len(by_tensor)))
    header = ["tensor"] + phases + ["total"]
    rows = sorted(by_tensor.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    table = [header] + [[name] + ["%.3f" % (times.get(p, 0.0) / 1e3) for p in phases] +
                        ["%.3f" % (sum(times.values()) / 1e3)] for name, times in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  " + "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                                      for i, cell in enumerate(r)))

    lines.append("")
    lines.append("Time per phase, ms (all tensors; a backend's parts are on the group rows):")
    per_phase = collections.defaultdict(float)
    for row, phase, _, duration, _ in finished:
        if row.startswith("group ") and phase in {p for _, p, _, _, _ in tensors}:
            continue  # the group's own collective span repeats its tensors'
        per_phase[phase] += duration
    for phase, total in sorted(per_phase.items(), key=lambda kv: -kv[1]):
        lines.append("  %-24s %12.3f" % (phase, total / 1e3))

    waited = collections.Counter()
    waited_ms = collections.defaultdict(float)
    for row, phase, _, duration, args in tensors:
        if phase == "NEGOTIATE":
            for rank in args.get("waited_for", []):
                waited[rank] += 1
                waited_ms[rank] += duration
    lines.append("")
    if waited:
        lines.append("Ranks the negotiations waited for (the last to be ready):")
        for rank, count in waited.most_common():
            lines.append("  rank %-4d %6d times, in negotiations that took %.3f ms in all" % (
                rank, count, waited_ms[rank] / 1e3))
    else:
        lines.append("No negotiation waited for a rank: every rank was ready in the same cycle.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m unison.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=20, help="tensors to list (the busiest)")
    args = parser.parse_args(argv)
    try:
        events = load(args.path)
    except OSError as e:
        print("unison.timeline: cannot read %s: %s" % (args.path, e), file=sys.stderr)
        return 1
    print(summarize(events, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
