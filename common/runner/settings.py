"""The core's settings as the launcher sees them: the rows of the core's one
settings table (native/config.cc, through basics.setting_table()) that have
a unisonrun option, from which command_line.py makes the options and
config_file.py the keys of horovodrun's config file."""
from unison import basics

# The units a setting's option may take instead of the variable's own (the
# table's flag_unit): the fusion threshold is given in MiB, as horovodrun's
# --fusion-threshold-mb, and read by the core in bytes.
UNIT_BYTES = {"MiB": 1024 * 1024}
NUMERIC = ("integer", "bytes", "number")


def core_settings():
    """The rows of the core's settings table that have a launcher option."""
    return [row for row in basics.setting_table() if row["flag"]]


def dest(row):
    """The attribute of the parsed arguments that holds a setting's option."""
    return row["flag"][2:].replace("-", "_")
