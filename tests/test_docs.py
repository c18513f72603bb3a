"""The documentation site's own checks, beyond `mkdocs build --strict`
(which the `docs` tox env runs first, and which fails on a broken link,
page or reference):

- every code block marked runnable runs: a block after a `<!-- runnable -->`
  line in this process, one after `<!-- runnable: unisonrun -np N -->` as a
  job of N ranks under the launcher, and fails if it raises;
- every unison module the migration guide names exists;
- every name of the public API (a documented module's `__all__`) has a
  docstring, and so has every public method, property and class attribute
  of its classes, so that the API reference leaves nothing out (mkdocstrings
  leaves out what has no docstring).

Runs in the `docs` env, which has the site's builder (griffe reads the
modules without importing them, so TensorFlow and MXNet need not be there)
and torch, for the runnable blocks."""
import os
import re
import subprocess
import sys

import griffe
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
MARKER = re.compile(r"^<!-- runnable(?:: unisonrun -np (\d+))? -->\n```python\n(.*?)^```$", re.M | re.S)


def _pages():
    for folder, _, files in os.walk(DOCS):
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.join(folder, name)


def _runnable_blocks():
    for path in _pages():
        text = open(path).read()
        for match in MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 3
            where = "%s:%d" % (os.path.relpath(path, ROOT), line)
            yield pytest.param(where, int(match.group(1) or 1), match.group(2), id=where)


def test_the_docs_have_runnable_blocks():
    # A typo in the marker would make every block quietly plain text.
    assert len(list(_runnable_blocks())) >= 5
    for path in _pages():
        for line in open(path):
            if "runnable" in line and line.startswith("<!--"):
                assert re.match(r"^<!-- runnable(?:: unisonrun -np \d+)? -->$", line.strip()), (path, line)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where,ranks,code", list(_runnable_blocks()))
def test_runnable_block(where, ranks, code, tmp_path):
    if ranks == 1:
        # In this process, as a reader pasting it into Python would run it.
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(code, where, "exec"), namespace)
        finally:
            import unison
            if unison.is_initialized():
                unison.shutdown()
        return
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "unison.run", "-np", str(ranks), sys.executable, str(script)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert run.returncode == 0, "%s failed under unisonrun -np %d:\n%s" % (where, ranks, run.stdout.decode())


def _module_paths_in_the_migration_guide():
    text = open(os.path.join(DOCS, "migrating.md")).read()
    table = text[text.index("## Import paths"):text.index("## What behaves differently")]
    names = set()
    for row in table.splitlines():
        cells = row.split("|")
        if len(cells) > 3:
            names.update(re.findall(r"`(unison(?:\.[a-z_]+)*)", cells[2]))
    return sorted(names)


def _the_package():
    """unison as griffe reads it from its files (importing nothing), with
    every alias inside it resolved, as mkdocstrings reads it."""
    loader = griffe.GriffeLoader()
    package = loader.load("unison")
    unresolved, _ = loader.resolve_aliases(external=False, implicit=False)
    assert not unresolved, "names the API reference cannot follow: %s" % sorted(unresolved)
    return package


def test_the_migration_guide_names_modules_that_exist():
    package = _the_package()
    names = _module_paths_in_the_migration_guide()
    assert len(names) >= 25
    for name in names:
        member = package
        for part in name.split(".")[1:]:
            assert part in member.members, "the migration guide names %s, which unison lacks" % name
            member = member.members[part]


def _documented_modules():
    names = []
    for path in _pages():
        names += re.findall(r"^::: (unison[\w.]*)$", open(path).read(), re.M)
    return names


def test_every_public_name_has_a_docstring():
    package = _the_package()
    missing = []
    for module_name in _documented_modules():
        module = package
        for part in module_name.split(".")[1:]:
            module = module.members[part]
        if not module.is_module:
            continue
        exported = module.exports
        if exported is None:
            exported = [name for name, member in module.members.items()
                        if not name.startswith("_") and not member.is_alias]
        for name in exported:
            member = module.members[name]
            target = member.final_target if member.is_alias else member
            if target.is_module:
                continue
            if not (target.docstring and target.docstring.value.strip()):
                missing.append("%s.%s" % (module_name, name))
            if target.is_class:
                missing += _undocumented_members(target)
    assert not missing, "public names without a docstring: %s" % ", ".join(sorted(set(missing)))


def _undocumented_members(cls):
    """A public class's own public methods, properties and class attributes
    without a docstring (instance attributes are its state, which the
    class's docstring describes)."""
    missing = []
    for name, member in cls.members.items():
        if name.startswith("_"):
            continue
        target = member.final_target if member.is_alias else member
        documented = target.docstring and target.docstring.value.strip()
        if target.is_function or (target.is_attribute and {"class-attribute", "property"} & target.labels):
            if not documented:
                missing.append(target.path)
    return missing


def test_the_performance_page_shows_what_the_recorded_runs_printed():
    """docs/performance.md's figures are benchmarks/render.py's output from
    the runs kept in benchmarks/results/, never typed by hand."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import render
    finally:
        sys.path.pop(0)
    runs = render.load()
    for benchmark in ("allreduce", "torch_train"):
        assert runs.get(benchmark), "benchmarks/results/ has no run of %s.py" % benchmark
        for run in runs[benchmark]:
            assert run["tables"] and run["command"] and run["machine"]["memcpy_gbps"] > 0, run["file"]
    with open(render.PAGE) as f:
        page = f.read()
    assert render.page_with(render.markdown(), page) == page, (
        "docs/performance.md differs from what benchmarks/results/ gives: run python benchmarks/render.py")
    for benchmark in render.PLOTS:
        assert os.path.exists(os.path.join(render.IMAGES, benchmark + ".png")), benchmark


def _project_files():
    try:
        listed = subprocess.run(["git", "-C", ROOT, "ls-files"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                check=True).stdout.decode().split("\n")
    except (OSError, subprocess.CalledProcessError):  # not a checkout: every file under the root
        listed = [os.path.relpath(os.path.join(folder, name), ROOT)
                  for folder, _, files in os.walk(ROOT) if "/." not in folder for name in files]
    return [name for name in listed if name and os.path.isfile(os.path.join(ROOT, name))]


def test_no_file_speaks_of_development_sessions():
    """The history of the work is git's; the files say what is, and the
    design notes say what was found, without a diary's session numbers."""
    diary = re.compile(r"\bsessions? \d+", re.I)
    found = []
    for name in _project_files():
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if diary.search(line):
                        found.append("%s:%d: %s" % (name, number, line.strip()[:100]))
        except UnicodeDecodeError:  # a binary file
            continue
    assert not found, "\n".join(found)
