"""The adapters' compiled paths as a user meets them, one fresh process
each: unison.torch's per-tensor extension (torch_adapter/fast_path.cc) and
unison.tensorflow's op kernels (tf_adapter/kernels.cc, and the XLA lowering
of kernels_xla.cc, which --check-build reports). Each is built at
first import, loaded from the cache afterwards without compiling, refused
with a warning that says why (and then the adapter's Python path), made an
error by its setting =1, chosen off by =0. What they compute is the shared
grid's (tests/parallel). Each framework's tox env runs its own cases."""
import json
import os
import stat
import subprocess
import sys
from collections import namedtuple

import pytest

# Imports unison.torch, runs an allreduce twice (the second through the
# compiled path where it is in use) and says which path was active, how
# many ops the compiled path started, and what was warned.
TORCH_SCRIPT = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import unison.torch as hvd
    from unison import adapter_extension
    from unison.torch import ops
hvd.init()
x = torch.ones(3)
for _ in range(2):
    hvd.allreduce_(x, name="x", op=hvd.Sum)
print(json.dumps({"active": adapter_extension.ACTIVE["PyTorch"], "values": x.tolist(),
                  "started": ops._fast.started() if ops._fast is not None else None,
                  "warnings": [str(w.message) for w in caught if "unison" in str(w.message)]}))
"""

# Imports unison.tensorflow, runs an allreduce in a tf.function twice and
# says which path was active, how many of the graph's nodes are the
# compiled kernels' ops, and what was warned.
TENSORFLOW_SCRIPT = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import tensorflow as tf
    import unison.tensorflow as hvd
    from unison import adapter_extension
hvd.init()
step = tf.function(lambda t: hvd.allreduce(t, name="x", op=hvd.Sum))
x = tf.ones(3)
for _ in range(2):
    x = step(x)
graph = step.get_concrete_function(x).graph
print(json.dumps({"active": adapter_extension.ACTIVE["TensorFlow"], "values": x.numpy().tolist(),
                  "started": sum(op.type.startswith("Unison") for op in graph.get_operations()) or None,
                  "warnings": [str(w.message) for w in caught if "unison" in str(w.message)]}))
"""

Adapter = namedtuple("Adapter", "framework script label setting python_path")
ADAPTERS = {
    "torch": Adapter("torch", TORCH_SCRIPT, "PyTorch", "UNISON_TORCH_FAST_PATH", "the Python path"),
    "tensorflow": Adapter("tensorflow", TENSORFLOW_SCRIPT, "TensorFlow", "UNISON_TF_KERNELS",
                          "tf.py_function nodes"),
}


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request):
    """Each adapter with a compiled path, where its framework is installed."""
    found = ADAPTERS[request.param]
    pytest.importorskip(found.framework)
    return found


def run(adapter, env, timeout=240):
    done = subprocess.run([sys.executable, "-c", adapter.script], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **env))
    return done, (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None)


def test_built_once_then_loaded_from_the_cache_without_compiling(tmp_path, adapter):
    cache, compiler, ran = tmp_path / "cache", tmp_path / "c++", tmp_path / "compiled"
    compiler.write_text("#!/bin/sh\necho >> %s\nexec g++ \"$@\"\n" % ran)
    compiler.chmod(0o755)
    env = {"UNISON_CACHE_DIR": str(cache), "CXX": str(compiler)}
    done, first = run(adapter, env)
    assert first is not None, done.stderr[-3000:]
    assert first["active"].startswith("compiled") and " (built %s" % cache in first["active"], first
    assert first["started"] == 1 and first["values"] == [1.0] * 3 and first["warnings"] == [], first
    assert ran.read_text().count("\n") == 1
    # The same compiler (the same key), which would now fail: it must not run.
    compiler.write_text("#!/bin/sh\necho >> %s\nexit 1\n" % ran)
    done, second = run(adapter, env)
    assert second is not None, done.stderr[-3000:]
    assert second["active"].startswith("compiled") and " (cached %s" % cache in second["active"], second
    assert second["started"] == 1 and second["warnings"] == [], second
    assert ran.read_text().count("\n") == 1
    library = second["active"].split(" (cached ", 1)[1].rstrip(")")
    assert stat.S_IMODE(os.stat(library).st_mode) & 0o022 == 0
    assert stat.S_IMODE(os.stat(os.path.dirname(library)).st_mode) == 0o700


def test_without_a_compiler_it_warns_once_saying_why_and_the_python_path_works(tmp_path, adapter):
    done, result = run(adapter, {"UNISON_CACHE_DIR": str(tmp_path / "cache"), "CXX": "/nonexistent/c++"})
    assert result is not None, done.stderr[-3000:]
    assert result["active"] == ("%s: no C++ compiler: /nonexistent/c++ is not on PATH (set CXX to one)"
                                % adapter.python_path)
    assert result["started"] is None and result["values"] == [1.0] * 3
    assert len(result["warnings"]) == 1 and "no C++ compiler: /nonexistent/c++" in result["warnings"][0] and \
        "%s=0" % adapter.setting in result["warnings"][0], result


def test_a_failed_build_says_where_its_output_is(tmp_path, adapter):
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'source.cc:1: error: this compiler is broken' >&2\nexit 3\n")
    compiler.chmod(0o755)
    done, result = run(adapter, {"UNISON_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(compiler)})
    assert result is not None, done.stderr[-3000:]
    assert result["active"].startswith("%s: the build failed (exit status 3; its output is in "
                                       % adapter.python_path), result
    assert "error: this compiler is broken" in result["active"] and len(result["warnings"]) == 1
    log = result["active"].split("its output is in ")[1].split(")")[0]
    assert "this compiler is broken" in open(log).read()


def test_a_cache_others_may_write_is_not_loaded(tmp_path, adapter):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)   # past the umask
    done, result = run(adapter, {"UNISON_CACHE_DIR": str(cache)})
    assert result is not None, done.stderr[-3000:]
    assert result["active"] == ("%s: the folder %s may be written by other users (mode 777); "
                                "nothing there is loaded" % (adapter.python_path, cache)), result
    assert result["values"] == [1.0] * 3 and len(result["warnings"]) == 1


def test_the_setting_chooses_off_requires_or_is_refused_naming_its_value(tmp_path, adapter):
    setting = adapter.setting
    done, result = run(adapter, {setting: "0", "CXX": "/nonexistent/c++"})
    assert result is not None, done.stderr[-3000:]
    assert result == {"active": "%s (%s=0)" % (adapter.python_path, setting), "values": [1.0] * 3,
                      "started": None, "warnings": []}
    done, _ = run(adapter, {setting: "1", "UNISON_CACHE_DIR": str(tmp_path / "c"), "CXX": "/nonexistent/c++"})
    assert done.returncode != 0
    assert ("UnsupportedError: unison: %s=1, but unison.%s's compiled" % (setting, adapter.framework)) in done.stderr
    assert "cannot be used: no C++ compiler" in done.stderr, done.stderr[-3000:]
    done, _ = run(adapter, {setting: "sometimes"})
    assert done.returncode != 0
    assert "%s='sometimes'" % setting in done.stderr, done.stderr[-3000:]


def test_unisonrun_refuses_a_bad_value_before_any_rank_starts(tmp_path, adapter):
    done = subprocess.run([sys.executable, "-m", "unison.run", "-np", "2", sys.executable, "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, **{adapter.setting: "maybe"}))
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "%s='maybe'" % adapter.setting in done.stderr, done.stderr


def test_unisonrun_check_build_says_which_path_is_active(tmp_path, adapter):
    def check_build(**env):
        done = subprocess.run([sys.executable, "-m", "unison.run", "--check-build"], capture_output=True, text=True,
                              timeout=240, env=dict(os.environ, **env))
        assert done.returncode == 0, done.stderr
        return done.stdout
    said = check_build()   # in the suite's own cache, which its other tests have filled by now
    assert "Compiled paths (built against the installed framework at first import):\n" in said, said
    assert "    [X] %s: compiled" % adapter.label in said, said
    if adapter.framework == "tensorflow":   # and its XLA lowering, built by --check-build where not yet
        assert "    [X] TensorFlow under XLA: compiled (" in said, said
    said = check_build(**{adapter.setting: "0"})
    assert "    [ ] %s: %s (%s=0)" % (adapter.label, adapter.python_path, adapter.setting) in said, said
    if adapter.framework == "tensorflow":
        assert ("    [ ] TensorFlow under XLA: collectives refused under XLA: allreduce lowers to it through the "
                "compiled kernels\n") in said, said


# Traces an allreduce under XLA, and the same without XLA, and says what
# each did and what --check-build's table of paths holds.
XLA_SCRIPT = r"""
import json
import tensorflow as tf
import unison, unison.tensorflow as hvd
from unison import adapter_extension
hvd.init()
try:
    tf.function(lambda t: hvd.allreduce(t, name="x", op=hvd.Sum), jit_compile=True, autograph=False)(tf.ones(3))
    refused = None
except unison.UnsupportedError as e:
    refused = str(e)
plain = tf.function(lambda t: hvd.allreduce(t, name="y", op=hvd.Sum))(tf.ones(3))
print(json.dumps({"refused": refused, "plain": plain.numpy().tolist(), "active": adapter_extension.ACTIVE}))
"""


def test_tensorflow_where_the_xla_lowering_does_not_build_xla_is_refused_saying_why_and_the_kernels_work(tmp_path):
    pytest.importorskip("tensorflow")
    compiler = tmp_path / "c++"   # builds the kernels, fails the XLA lowering
    compiler.write_text("#!/bin/sh\ncase \"$*\" in *kernels_xla.cc*) echo 'kernels_xla.cc:1: error: no XLA here' >&2; "
                        "exit 3;; esac\nexec g++ \"$@\"\n")
    compiler.chmod(0o755)
    done = subprocess.run([sys.executable, "-c", XLA_SCRIPT], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, UNISON_CACHE_DIR=str(tmp_path / "cache"), CXX=str(compiler)))
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["plain"] == [1.0] * 3 and said["active"]["TensorFlow"].startswith("compiled (built "), said
    assert said["refused"] is not None and ("allreduce of 'x' is traced inside a function compiled with XLA "
                                            "(jit_compile=True), and allreduce cannot be lowered to XLA here: the "
                                            "build failed (exit status 3; its output is in ") in said["refused"], said
    assert "error: no XLA here" in said["refused"] and "jit_compile=False" in said["refused"], said
    assert said["active"]["TensorFlow under XLA"].startswith("collectives refused under XLA: the build failed"), said

