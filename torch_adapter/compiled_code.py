"""torch.compile and unison: which of unison's files TorchDynamo traces.

A collective inside a compiled function is a `unison::` operator, one node
of the graph (registered_ops.py). Dynamo reaches it by tracing the public
function the program called (ops.py), which hands over to graph_ops.py
while Dynamo traces; SyncBatchNorm's forward (sync_batch_norm.py), the
compressors (unison.compression and unison.torch.compression) and the
argument rules (unison.arguments), all plain Python, are traced the same
way. Those files are all Dynamo may
read of unison.

Every other unison file is on Dynamo's skip list, as the standard
library's are: the core is reached through cffi, which Dynamo cannot
trace, and what it made of the Python up to each C call was wrong (a
model holding SyncBatchNorm failed its first compiled step in a view of
the buffer the core hands back). A call into a skipped file from compiled
code is a graph break: it runs as plain Python between two graphs, or is
Dynamo's error under fullgraph=True. Dynamo is imported lazily by
torch.compile, and importing it at `import unison.torch` costs 1.5 s on the
2-core VM, so the list is registered when it loads."""
import importlib.abc
import importlib.machinery
import pkgutil
import sys

_TRACE_RULES = "torch._dynamo.trace_rules"
# The files Dynamo traces, by module name.
TRACED = frozenset({"unison.torch.ops", "unison.torch.graph_ops", "unison.torch.sync_batch_norm",
                    "unison.torch.compression", "unison.arguments", "unison.compression"})


def keep_unison_out_of_compiled_graphs():
    if _TRACE_RULES in sys.modules:
        _skip_unison(sys.modules[_TRACE_RULES])
    elif not any(isinstance(finder, _WhenDynamoLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenDynamoLoads())


def skipped_modules():
    """unison's modules and subpackages that Dynamo skips: all but TRACED.
    The root package holds unison.torch in an installed wheel, so the list
    names what is beside it, not the root's folder, which would cover it."""
    names = []
    # From sys.modules: called at the end of unison.torch's own import when
    # Dynamo is already loaded, before `unison.torch` is an attribute of `unison`.
    for package in (sys.modules["unison"], sys.modules["unison.torch"]):
        for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if module.name not in TRACED and module.name != "unison.torch":
                names.append(module.name)
    return names


def _skip_unison(trace_rules):
    # trace_rules.add is how torch itself registers a module or package to
    # skip, by the path of its file or folder. A torch without it compiles
    # as before: graph breaks at each C call.
    add = getattr(trace_rules, "add", None)
    if add is None:
        return
    for name in skipped_modules():
        add(name)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when Dynamo's trace rules are imported, has
    them skip unison as soon as they have loaded."""

    def find_spec(self, name, path, target=None):
        if name != _TRACE_RULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _skip_unison(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)   # loaded once: nothing more to watch for
        spec.loader.exec_module = exec_module
        return spec
