"""The settings as the docs print them: one row per variable the core
reads, made from the core's own table (native/config.cc, through
core.setting_table()), so the page cannot disagree with the parser, with
unisonrun's options or with horovodrun's config file, which come from the
same rows; and unisonrun's other options, made from its argument parser.
`python -m unison.settings_page` prints both in Markdown; the docs'
settings page (docs/settings.md) holds its output, and a test keeps them
equal."""
from unison import core

_BYTE_UNITS = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]


def _size(value):
    value = int(value)
    for unit, name in _BYTE_UNITS:
        if value >= unit and value % unit == 0:
            return "%d %s" % (value // unit, name)
    return "%d bytes" % value


def _number(value):
    return "{:,}".format(int(value)) if value == int(value) else "%g" % value


def takes(row):
    """What a value of the setting may be."""
    kind, low, high = row["kind"], row["minimum"], row["maximum"]
    if kind == "bytes":
        return "a size, %s to %s" % (_size(low), _size(high))
    if kind in ("integer", "number"):
        return "%s, %s to %s" % ("an integer" if kind == "integer" else "a number", _number(low), _number(high))
    if kind == "core-list":
        return "cores, each 0 to %s" % _number(high)
    if kind == "choice":
        return " or ".join("`%s`" % c for c in row["choices"])
    if kind == "flag":
        return "a flag"
    if kind == "auto-or-flag":
        return "`auto` or a flag"
    if kind == "secret":
        return "at least %d bytes" % row["minimum"]
    if kind == "path":
        return "a file name"
    return "text"


def default(row):
    if row["default"] == "":
        return "unset"
    return _size(row["default"]) if row["kind"] == "bytes" else row["default"]


def option(row):
    if not row["flag"]:
        return ""
    return "`%s`%s" % (row["flag"], " (in %s)" % row["flag_unit"] if row["flag_unit"] else "")


def markdown():
    """The table, in Markdown."""
    lines = ["| variable | takes | default | `unisonrun` option | config file key | meaning |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in core.setting_table():
        name = "`%s`" % row["name"]
        if row["horovod_name"]:
            name += " (`%s`)" % row["horovod_name"]
        key = "`%s`" % row["config_key"] if row["config_key"] else ""
        lines.append("| %s | %s | %s | %s | %s | %s |" % (name, takes(row), default(row), option(row), key,
                                                          row["description"].replace("|", "\\|")))
    return "\n".join(lines) + "\n"


CORE_SETTINGS_GROUP = "the core's settings"


def launcher_options():
    """unisonrun's options other than the core's settings (which markdown()
    gives), group by group as its parser holds them, in Markdown."""
    from unison.runner import command_line
    parser = command_line.parser()
    sections = []
    # argparse keeps its groups and their options in these attributes only.
    for group in parser._action_groups:
        if group.title == CORE_SETTINGS_GROUP:
            continue
        rows = []
        for action in group._group_actions:
            if not action.option_strings or action.help is None or action.dest == "help":
                continue
            names = ", ".join("`%s`" % name for name in action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or {int: "N", float: "NUMBER"}.get(action.type, "VALUE")
                names += " *%s*" % (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
            rows.append("| %s | %s |" % (names, action.help.replace("%%", "%").replace("|", "\\|")))
        if not rows:
            continue
        title = "the launcher's own" if group.title == "options" else group.title
        if not title.startswith("horovodrun"):  # a command's name keeps its case
            title = title[0].upper() + title[1:]
        heading = ["### " + title, ""]
        if group.description:
            heading += ["%s%s." % (group.description[0].upper(), group.description[1:]), ""]
        sections.append("\n".join(heading + ["| option | what it does |", "| --- | --- |"] + rows) + "\n")
    return "\n".join(sections)


if __name__ == "__main__":
    print(markdown(), end="")
    print()
    print(launcher_options(), end="")
