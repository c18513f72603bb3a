"""unisonrun --config-file: horovodrun's settings file.

The file has horovodrun's sections (controller, params, autotune, timeline,
stall_check, library_options, logging) with horovodrun's keys, so a Horovod
job's file works unchanged. An option given on the command line wins over
the file. Unlike horovodrun, an unknown section or key is an error naming
it: a misspelt key would otherwise leave a setting silently at its default.

YAML needs PyYAML (`pip install pyyaml`); a file in JSON, which is YAML too,
needs nothing.
"""
import json

from unison.runner.settings import core_settings, dest

# section -> key -> (the launcher option's dest, the type its value must
# have). The keys that set a core setting come from the core's settings
# table (its config_key column, with the choices and the sense the table
# gives them); these are horovodrun's keys with no core setting behind them. A dest of None: a horovodrun setting with nothing to
# set here (see the options' help), accepted so that a Horovod file loads.
_NUMBER = (int, float)
_LAUNCHERS_OWN = {
    "params": {"hierarchical_allgather": ("hierarchical_allgather", bool)},
    "autotune": {"bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
                 "gaussian_process_noise": ("autotune_gaussian_process_noise", _NUMBER)},
    "timeline": {},
    "stall_check": {},
    "library_options": {"mpi_threads_disable": ("mpi_threads_disable", bool),
                        "num_nccl_streams": ("num_nccl_streams", int),
                        "ccl_bgt_affinity": (None, int)},
    "logging": {"with_timestamp": ("log_with_timestamp", bool)},
}
_KIND_TYPES = {"integer": int, "bytes": _NUMBER, "number": _NUMBER, "flag": bool}


def sections():
    """section -> key -> (dest, type, the words it takes or None, whether it
    is the option's opposite): the table's keys and the launcher's own. A
    flag whose option is --no-X is set by X's key, the opposite: the stall
    check's `enabled` sets --no-stall-check."""
    known = {section: {key: (dest_, kind, None, False) for key, (dest_, kind) in keys.items()}
             for section, keys in _LAUNCHERS_OWN.items()}
    for row in core_settings():
        if row["config_key"]:
            section, _, key = row["config_key"].partition(".")
            known.setdefault(section, {})[key] = (dest(row), _KIND_TYPES.get(row["kind"], str), row["choices"],
                                                  row["flag"].startswith("--no-"))
    return known


def _load(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError("cannot read it: %s" % e.strerror) from None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml
    except ImportError:
        raise ValueError("it is not JSON, and reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError("not valid YAML: %s" % e) from None


def apply(args, path, given):
    """Sets, from the file at `path`, every option of `args` whose dest is not
    in `given` (those set on the command line). Raises ValueError naming the
    key for anything wrong."""
    config = _load(path)
    if config is None:
        return
    if not isinstance(config, dict):
        raise ValueError("it must be a mapping of sections, not %s" % type(config).__name__)
    known = sections()
    for section, values in config.items():
        if section == "controller":
            if not isinstance(values, str) or values.lower() not in ("gloo", "mpi"):
                raise ValueError("controller: %r is not 'gloo' or 'mpi'" % (values,))
            if not (args.gloo or args.mpi):
                setattr(args, values.lower(), True)
            continue
        keys = known.get(section)
        if keys is None:
            raise ValueError("unknown section %r (known: controller, %s)" % (section, ", ".join(known)))
        if not isinstance(values, dict):
            raise ValueError("%s: must be a mapping of keys, not %r" % (section, values))
        for key, value in values.items():
            if key not in keys:
                raise ValueError("unknown key %s.%s (known: %s)" % (section, key, ", ".join(sorted(keys))))
            dest_, kind, choices, inverted = keys[key]
            # bool is an int to Python; a number where a flag goes is a mistake.
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ValueError("%s.%s: %r is not a %s" % (section, key, value, _kind_name(kind)))
            if kind is not bool and kind is not str and value < 0:
                raise ValueError("%s.%s: %r must be 0 or more" % (section, key, value))
            if inverted:
                value = not value
            if choices is not None:
                if value.lower() not in choices:
                    raise ValueError("%s.%s: %r is not one of %s" % (section, key, value, ", ".join(choices)))
                value = value.lower()
            if (section, key) == ("autotune", "gaussian_process_noise") and value > 1:
                raise ValueError("autotune.gaussian_process_noise: %r must be within 0..1" % value)
            # Paths are taken from the working directory, as horovodrun does.
            if dest_ is not None and dest_ not in given:
                setattr(args, dest_, value)


def _kind_name(kind):
    if kind is _NUMBER:
        return "number"
    return {bool: "boolean", int: "whole number", str: "string"}[kind]
