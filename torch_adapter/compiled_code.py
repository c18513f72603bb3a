"""torch.compile and unison: a collective runs between compiled graphs.

A collective cannot be a node of a compiled graph. It calls the core
through cffi, which TorchDynamo cannot trace, and it must run when the
program reaches it, in the same order on every rank. Left to itself,
Dynamo inlines unison's Python up to each C call and compiles the pieces
in between, and what it makes of them is wrong: a model holding
hvd.SyncBatchNorm failed its first compiled step in a view of the buffer
the core hands back.

So Dynamo is told to skip unison's files, as it skips the standard
library's. A call into unison from compiled code ends the graph there
(a graph break), runs as plain Python, and the next graph starts after
it. Under torch.compile(fullgraph=True) that break is Dynamo's error
naming the unison function. torch.compiler.disable on every entry point
would do the same through a public API, but it imports Dynamo (1.5 s at
`import unison.torch` on the 2-core VM) and wraps each call (0.6 us
more per collective, measured); this costs neither. Dynamo is imported
lazily by torch.compile, so the skip is registered when it loads."""
import importlib.abc
import importlib.machinery
import sys

_TRACE_RULES = "torch._dynamo.trace_rules"
_PACKAGES = ("unison", "unison.torch")   # two folders in a source checkout


def keep_unison_out_of_compiled_graphs():
    if _TRACE_RULES in sys.modules:
        _skip_unison(sys.modules[_TRACE_RULES])
    elif not any(isinstance(finder, _WhenDynamoLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenDynamoLoads())


def _skip_unison(trace_rules):
    # trace_rules.add is how torch itself registers a package to skip. A
    # torch without it compiles as before: graph breaks at each C call.
    add = getattr(trace_rules, "add", None)
    if add is not None:
        for package in _PACKAGES:
            add(package)


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
