"""The import graph of the root package `unison` (common/) has no circles.

A circle between two modules makes each half-initialised while the other
imports, which is why such imports end up hidden inside functions; the
graph here counts those as well. It is read from the source with `ast`, in
milliseconds, without importing anything.

What counts as an edge from module A to module B:
- `import B` and `from B import name`, at any depth of A (inside a function
  too);
- `from P import B` where P.B is a module: the edge goes to P.B, not to P;
- importing B.C.D also runs the `__init__` of the packages B.C on its way,
  so it is an edge to those as well, except to the root package `unison`,
  whose `__init__` every module's import runs (its facade, not a
  dependency); an explicit `import unison` or `from unison import name` of
  a name that is not a module is an edge to the root like any other.
"""
import ast
import os
import sys

COMMON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common")
ROOT = "unison"


def modules():
    """{module name: path} for every .py file of common/."""
    found = {}
    for folder, subfolders, files in os.walk(COMMON):
        subfolders[:] = [s for s in subfolders if s != "__pycache__"]
        for file in files:
            if file.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, file), COMMON)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([ROOT] + parts)] = os.path.join(folder, file)
    return found


def edges(found):
    graph = {}
    for name, path in found.items():
        is_package = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for alias in node.names:
                    submodule = source + "." + alias.name
                    targets.add(submodule if submodule in found else source)
        reached = set()
        for target in targets:
            if target in found:
                reached.add(target)
                parts = target.split(".")
                reached.update(".".join(parts[:i]) for i in range(2, len(parts)))
        graph[name] = {t for t in reached if t in found and t != name}
    return graph


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's
    algorithm, without recursion)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_root_package_has_no_import_circles():
    graph = edges(modules())
    found = circles(graph)
    assert not found, "import circles in common/:\n" + "\n".join(
        "  %s\n%s" % (", ".join(c), "\n".join("    %s -> %s" % (m, ", ".join(sorted(graph[m] & set(c)))) for m in c))
        for c in found)


def test_the_checker_sees_a_circle_hidden_inside_a_function_and_through_a_package(tmp_path, monkeypatch):
    """The checker itself: a circle through an import inside a function,
    and one through a subpackage's __init__, are both found."""
    package = tmp_path / "common"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from unison.a import f\n")
    (package / "a.py").write_text("def f():\n    from unison import b\n")
    (package / "b.py").write_text("from unison.a import f\n")
    (package / "sub" / "__init__.py").write_text("from unison import c\n")
    (package / "sub" / "worker.py").write_text("X = 1\n")
    (package / "c.py").write_text("def g():\n    from unison.sub.worker import X\n")
    (package / "d.py").write_text("import unison\nfrom unison import a\n")
    monkeypatch.setattr(sys.modules[__name__], "COMMON", str(package))
    graph = edges(modules())
    assert graph["unison.c"] == {"unison.sub", "unison.sub.worker"}
    assert graph["unison.d"] == {"unison", "unison.a"}
    assert sorted(circles(graph)) == [["unison.a", "unison.b"], ["unison.c", "unison.sub"]]
