"""The hosts of a job: -H's `host:slots` list, a hostfile, and which rank
goes on which host."""
import re


def parse_hostfile(path):
    """Lines of `host slots=N`, `host:N` or `host`; '#' starts a comment.
    Returns "host:N,..." as -H takes it."""
    hosts = []
    try:
        f = open(path)
    except OSError as e:
        raise SystemExit("unisonrun: --hostfile %s: cannot read it: %s" % (path, e.strerror)) from None
    with f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.match(r"^(\S+?)(?::(\d+))?(?:\s+slots\s*=\s*(\d+))?\s*$", line)
            if not match:
                raise SystemExit("unisonrun: cannot read hostfile line %r; write `host slots=N` or `host:N`" % line)
            name, colon, slots = match.groups()
            hosts.append("%s:%s" % (name, slots or colon or "1"))
    if not hosts:
        raise SystemExit("unisonrun: hostfile %s names no hosts" % path)
    return ",".join(hosts)


def slots(hosts):
    return sum(int(h.rsplit(":", 1)[1]) if ":" in h else 1 for h in hosts.split(","))


def parse_hosts(args):
    """[(host, slots)] from -H or --hostfile."""
    text = args.hosts or parse_hostfile(args.hostfile)
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not slots.isdigit() or int(slots) < 1 or not name:
            raise SystemExit("unisonrun: -H %s: write each host as host:slots, such as node1:4" % text)
        hosts.append((name, int(slots)))
    return hosts


def place(hosts, np_):
    """Each rank's host, filling the hosts in order."""
    total = sum(slots for _, slots in hosts)
    if total < np_:
        raise SystemExit("unisonrun: -np %d but the hosts have %d slots" % (np_, total))
    placed = []
    for name, slots in hosts:
        placed += [name] * min(slots, np_ - len(placed))
    return placed
