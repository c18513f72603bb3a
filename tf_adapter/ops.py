"""The collectives on TensorFlow tensors, with Horovod's TensorFlow API and
its gradients.

How a collective reaches the core: eagerly, a numpy view of the tensor
(no copy) goes to unison.numpy, and the core's aligned result is adopted by
TensorFlow through DLPack (no copy); inside a tf.function or a TF1 graph,
it is one node of the compiled asynchronous kernels (kernels.cc, loaded by
kernels.py), or, where those cannot be built, a `tf.py_function` node
running the same Python as the eager call. tf_adapter/README.md gives the
measured costs. AutoGraph is told to leave this Python alone
(_keep_autograph_out).

Ordering inside a graph: TensorFlow may run independent nodes in any order
and on any of its threads. So every collective node of a tf.function gets a
control dependency on the one traced before it: each rank runs them in
trace order, which is program order and the same everywhere, so the core
numbers unnamed tensors alike on every rank, and no two ranks can wait on
each other's different nodes (a py_function node blocks its thread until
the peers take part). Grouped ops are one node, so
their tensors reach the core together and fuse. A TF1 session graph is the
exception: see _session_node_name.

Gradients follow Horovod's definitions: allreduce's is the same allreduce
of the gradient; allgather's is this rank's rows of the averaged gradient;
broadcast's is the averaged gradient on the root and zero elsewhere;
alltoall's sends the gradient back along the received splits;
reducescatter's is the allgathered gradient (times the size for Sum).
"""
import itertools
import struct
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.ops import control_flow_util

from unison import adapter_extension, arguments, basics, collective, dtypes, elastic_worker, frontend, gradients
from unison.dtypes import label as _label
from unison.exceptions import DeadlockError, InvalidArgumentError, MismatchError, UnsupportedError
from unison.handles import GraphNode, HandleGroup, synchronize
from unison.numpy import NumpyTensors
from unison.process_sets import global_process_set
from unison.process_sets import process_set_id
from unison._native import lib
from unison.tensorflow import kernels as _kernel_library
from unison.tensorflow.compression import Compression

from unison.basics import Adasum, Average, Max, Min, Product, Sum  # noqa: E402,F401  (hvd.Sum, ... as Horovod's)

# The last collective node traced into each graph (see "Ordering" above).
_last_in_graph = weakref.WeakKeyDictionary()


def _keep_autograph_out():
    """Tell AutoGraph to call unison's Python as it is, as it calls
    TensorFlow's, Keras's and numpy's.

    A tf.function converts every function it reaches through user code that
    is not on AutoGraph's list of libraries, and a function defined inside a
    converted one is converted code too. So each collective node's Python
    (the nested `node` below, and what it calls) ran as AutoGraph's
    generated code on every step, each call through `converted_call`: that
    added about 0.1 ms to a small allreduce in a tf.function, twice what the
    whole op costs eagerly, and made tracing a step six times as long
    (docs/design-notes.md). Nothing here
    needs converting: no unison function branches or loops on a tensor's
    value. The list is TensorFlow's own (`autograph.core.config`), not a
    public API; where a later TensorFlow moves it, collectives stay correct
    and only lose this speed, and tests/parallel/test_tensorflow_ops.py
    says so."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return
    rule = config.DoNotConvert("unison")
    if not any(str(r) == str(rule) for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)


_keep_autograph_out()


def _alone(process_set):
    """Whether a collective over `process_set` may be left out because the
    set is one rank. Eagerly the question is asked again at every call. In a
    graph the answer is fixed when it is traced, and an elastic job that
    traced its step as a job of one runs that graph on after it grows: there
    the collective is always built (at one rank it costs one node)."""
    return process_set.size() == 1 and (tf.executing_eagerly() or not elastic_worker.in_elastic_job())


def _check(tensor, name):
    dtypes.code_of(tensor.dtype.name, name)
    device = tensor.device if tf.executing_eagerly() else ""
    if "GPU" in device.upper():
        raise UnsupportedError("unison: tensor %s is on %s; this build moves CPU tensors only"
                               % (_label(name), device))


def _view(tensor):
    """A CPU tensor's values as a read-only numpy view, without the copy
    that EagerTensor.numpy() makes."""
    view = getattr(tensor, "_numpy", None)
    return np.asarray(view() if view is not None else tensor.numpy())  # a scalar's is a numpy scalar


def aligned_empty(shape, dtype):
    """An uninitialised numpy array on a 64-byte boundary, which TensorFlow
    can adopt through DLPack without copying it."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + 64, dtype=np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)


class _InvalidArgument(InvalidArgumentError, tf.errors.InvalidArgumentError):
    """A bad argument, as unison's InvalidArgumentError and as TensorFlow's
    (the error Horovod's TensorFlow ops raise), so either except clause
    catches it."""

    # TensorFlow's own signature: autograph rebuilds an OpError raised while
    # tracing from (node_def, op, message, payloads).
    def __init__(self, node_def, op, message, *payloads):
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message, *payloads)


class _Mismatch(MismatchError, tf.errors.FailedPreconditionError):
    """Ranks that disagree, as unison's MismatchError and as TensorFlow's
    FailedPreconditionError (what Horovod's TensorFlow ops raise)."""

    def __init__(self, node_def, op, message, *payloads):
        tf.errors.FailedPreconditionError.__init__(self, node_def, op, message, *payloads)


def _as_tensorflow_error(error):
    """unison's error as the TensorFlow error class Horovod's ops raise,
    still an instance of unison's class; None where there is none."""
    message = "%s: %s" % (type(error).__name__, error)  # the class stays readable in graph errors
    if isinstance(error, MismatchError) and not isinstance(error, tf.errors.OpError):
        return _Mismatch(None, None, message)
    if type(error) is InvalidArgumentError:  # its subclasses (NotInitialized, Unsupported) keep theirs
        return _InvalidArgument(None, None, message)
    return None


class _AlignedArrays(NumpyTensors):
    """The numpy views of TensorFlow tensors; outputs are aligned so that
    TensorFlow adopts them without a copy."""

    def empty_like(self, array):
        return aligned_empty(array.shape, array.dtype)


_front = frontend.FrontEnd(_AlignedArrays())


def _to_tensor(array, dtype):
    """A tensor holding `array`: adopted through DLPack (no copy) when it
    is aligned and of a type DLPack carries; copied otherwise."""
    array = np.asarray(array)
    if array.size and array.ctypes.data % 64 == 0:
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (BufferError, TypeError, ValueError, tf.errors.OpError):
            pass   # bfloat16, bool on older numpy, read-only arrays: copy
    return tf.convert_to_tensor(array, dtype=dtype)


_NO_TENSOR = object()   # barrier and join: an op that names no tensor


def _lowered_to_xla(kind, name):
    """True where this node is traced into a function that XLA compiles,
    which allreduce then lowers to (kernels_xla.cc); False outside XLA.
    Any other collective traced under XLA is refused here, while tracing,
    naming it, why and the fix: XLA would otherwise fail only when the
    step first runs, with TensorFlow's "No registered 'EagerPyFunc'
    OpKernel for XLA_..." naming none of this. Keras 3 turns XLA on by
    itself (jit_compile="auto") wherever a GPU is visible."""
    if not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return False
    why = xla_refusal(kind)
    if not why:
        return True
    what = kind if name is _NO_TENSOR else "%s of %s" % (kind, _label(_group_label(name)))
    raise UnsupportedError(
        "unison: %s is traced inside a function compiled with XLA (jit_compile=True), and %s. Trace the step "
        "without XLA: tf.function(jit_compile=False), or model.compile(..., jit_compile=False) in Keras, whose "
        "default jit_compile='auto' turns XLA on wherever a GPU is visible (unison.keras's callbacks turn it off "
        "for model.fit where the optimizer's collectives cannot be compiled)" % (what, why))


def xla_refusal(kind="allreduce"):
    """"" where a `kind` collective can be compiled into an XLA program in
    this process, else why not, in words. Only allreduce (and grouped
    allreduce) lowers to XLA, as in Horovod; only on the CPU, since its
    GPU form needs the core's CUDA path (tf_adapter/README.md); and only
    through the compiled kernels, whose op it lowers. The first call with
    XLA possible builds the lowering (kernels.py, xla_problem)."""
    if kind != "allreduce":
        return "only allreduce and grouped allreduce are lowered to XLA; unison's %s runs outside XLA" % kind
    if _kernels is None:
        return ("allreduce lowers to XLA through unison's compiled kernels, which are not in use here (%s)"
                % adapter_extension.ACTIVE.get("TensorFlow"))
    if tf.config.list_logical_devices("GPU"):
        return "allreduce lowers to XLA's CPU programs only, and with a GPU visible XLA compiles for the GPU"
    problem = _kernel_library.xla_problem()
    return "allreduce cannot be lowered to XLA here: %s" % problem if problem else ""


# Per outermost function graph compiled by XLA: how many of its collective
# nodes have been traced.
_xla_nodes = weakref.WeakKeyDictionary()


def _xla_names(graph, kind, names):
    """The core's names for a node lowered to XLA, its unnamed tensors
    named kind.xlaK.i for the Kth node of the function. Inside an XLA
    program, the core cannot number them in program order: XLA may run
    independent custom calls in any order, or at once on several threads.
    Tracing order is the program's, the same on every rank, and counted
    per function it survives a retrace on one rank only. The programs a
    thread runs never overlap, so two functions' nodes may share names."""
    root = graph
    while getattr(getattr(root, "outer_graph", None), "building_function", False):
        root = root.outer_graph
    count = _xla_nodes.get(root, 0)
    _xla_nodes[root] = count + 1
    unnamed = itertools.count()
    return [n if n else "%s.xla%d.%d" % (kind, count, next(unnamed)) for n in names]


def _run(fn, inputs, out_dtypes, kind, name=_NO_TENSOR, compiled=None, names=(None,)):
    """fn(*numpy arrays) -> list of numpy arrays, as tensors: called now
    when eager, else as one graph node chained after the graph's previous
    collective: compiled(core names, awaited_by key) builds it from the
    compiled kernels where they are loaded (kernels.py), else it is a
    py_function node. In a py_function node inputs are viewed, outputs
    adopted: no copy on either side (a numpy_function node would copy every
    result). `kind` and `name` name the op and its tensors in errors raised
    while tracing; `names` are the core's names of the node's ops (None:
    numbered by the core)."""
    def call(*tensors):
        try:
            outputs = fn(*[_view(t) for t in tensors])
        except (MismatchError, InvalidArgumentError) as error:
            translated = _as_tensorflow_error(error)
            if translated is None:
                raise
            raise translated from error
        return [_to_tensor(o, d) for o, d in zip(outputs, out_dtypes)]
    if tf.executing_eagerly():
        return call(*inputs)
    lowered = _lowered_to_xla(kind, name)   # the compiled kernels' node, then, lowered by XLA
    graph = tf.compat.v1.get_default_graph()
    chained = graph.building_function   # see "Ordering" above, and _session_node_name
    if compiled is not None and _kernels is not None:
        if lowered:
            names = _xla_names(graph, kind, names)
        elif not chained:   # a TF1 session graph: every op named, as below for the py_function node
            prefix = _session_node_name(graph, kind)
            unnamed = itertools.count()
            names = [n if n else "%s.%d" % (prefix, next(unnamed)) for n in names]
        previous = _last_in_graph.get(graph) if chained else None
        with tf.control_dependencies([previous] if previous is not None else []):
            outputs = compiled([n or "" for n in names], _awaited_by(graph))
        if chained:
            _last_in_graph[graph] = outputs[0].op
        return list(outputs)
    traced_in = weakref.ref(graph)
    if tf.compat.v1.executing_eagerly_outside_functions():
        def node(*tensors):
            with GraphNode(_thread_waiting_for(traced_in)):
                return call(*tensors)
    else:
        prefix = _session_node_name(graph, kind)

        def node(*tensors):
            with GraphNode(_thread_waiting_for(traced_in)), collective.numbered_within(prefix):
                try:
                    return call(*tensors)
                except DeadlockError as error:
                    raise DeadlockError("%s%s" % (error, _SESSION_THREADS)) from error
    previous = _last_in_graph.get(graph) if chained else None
    with tf.control_dependencies([previous] if previous is not None else []):
        outputs = tf.py_function(node, list(inputs), list(out_dtypes), name="unison")
    if chained:
        _last_in_graph[graph] = outputs[0].op if outputs else None
    return list(outputs)


# Unchained, a session's collective nodes can also deadlock in a way no
# rank's program says: each holds one of the session's inter-op threads
# while it waits, and ranks whose threads are all taken by different nodes
# wait for each other.
_SESSION_THREADS = (
    "\n(In a TF1 session each collective node holds one of the session's inter-op threads while it waits. If "
    "more of a step's collective nodes can run at once than the session has threads (one per core by default), "
    "the ranks may each fill theirs with other nodes: give the session more, "
    "tf.compat.v1.ConfigProto(inter_op_parallelism_threads=N), or make the collectives one node, "
    "hvd.grouped_allreduce.)")

# Per TF1 session graph: [its number, the collective nodes traced into it so far].
_session_graphs = weakref.WeakKeyDictionary()
_session_graphs_seen = 0


def _session_node_name(graph, kind):
    """A name for a collective node of a TF1 graph (one run by
    tf.compat.v1.Session), under which its unnamed tensors go to the core.

    A session runs only the nodes a fetch needs, so chaining each node to
    the one before, as inside a tf.function, would make fetching a
    broadcast also run the gradients' allreduce built before it (and ask
    for its inputs). The session graph's own nodes are therefore not
    chained, and TensorFlow may start them in a different order on each
    rank. The core then pairs tensors by name, as Horovod's graph ops do,
    so no tensor may be left for the core to number in program order:
    each node is numbered in the order it was built, which is program
    order and the same on every rank (cond branches and functions inside
    the graph included), and its unnamed tensors become kind.nodeK.i. A
    script that builds more than one graph (one to train, one to evaluate)
    numbers them too, in the order their first collective was built, and
    the second graph's are kind.graph1.nodeK.i: two graphs' nodes never
    share a name, so a rank in one cannot pair with a rank in the other."""
    global _session_graphs_seen
    root = graph
    while getattr(root, "outer_graph", None) is not None:
        root = root.outer_graph
    numbers = _session_graphs.get(root)
    if numbers is None:
        numbers = _session_graphs[root] = [_session_graphs_seen, 0]
        _session_graphs_seen += 1
    which, count = numbers
    numbers[1] += 1
    return "%s.%snode%d" % (kind, "graph%d." % which if which else "", count)


try:
    from tensorflow.python.eager.polymorphic_function.atomic_function import AtomicFunction
    _CALLS_A_FUNCTION = AtomicFunction.call_flat.__code__
except (ImportError, AttributeError):   # a TensorFlow that runs functions otherwise: no caller is found
    _CALLS_A_FUNCTION = None
try:
    from tensorflow.python.client.session import BaseSession
    _RUNS_A_SESSION = BaseSession._do_call.__code__   # under Session.run and partial_run
except (ImportError, AttributeError):
    _RUNS_A_SESSION = None
_CALLERS = tuple(code for code in (_CALLS_A_FUNCTION, _RUNS_A_SESSION) if code is not None)


# The compiled kernels' awaited_by keys: one per graph (the graph a node is
# traced into), so that the core's deadlock test can ask which thread waits
# for a node only when it needs to (unison.h, unison_set_waiter_finder).
_graph_keys = weakref.WeakKeyDictionary()
_graphs_by_key = {}
_next_key = itertools.count(1)


def _awaited_by(graph):
    key = _graph_keys.get(graph)
    if key is None:
        key = _graph_keys[graph] = next(_next_key)
        _graphs_by_key[key] = weakref.ref(graph, lambda _, key=key: _graphs_by_key.pop(key, None))
    return key


def _find_waiter(key):
    """The Linux thread id waiting for the graph that `key` names; 0 where
    none is found."""
    traced_in = _graphs_by_key.get(key)
    return 0 if traced_in is None else _thread_waiting_for(traced_in)


def _thread_waiting_for(traced_in):
    """The native id of the thread that waits for this node (0 when none
    is found), for the deadlock test (GraphNode). Inside a tf.function: the
    thread whose innermost running tf.function was traced into the node's
    graph or a graph enclosing it (a tf.cond branch, an inner tf.function).
    In a TF1 graph: the thread running a tf.compat.v1.Session on it, when
    only one is (with several, which of them waits for this node is not
    known). TensorFlow runs the node on a worker of its own and says
    nothing of who waits; the waiting thread's Python stack does. It costs
    a few microseconds of a node's ~0.4 ms."""
    graph = traced_in()
    enclosing = set()
    root = graph
    while graph is not None:
        enclosing.add(id(graph))
        root, graph = graph, getattr(graph, "outer_graph", None)
    me = threading.get_ident()
    sessions = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        while frame is not None and frame.f_code not in _CALLERS:
            frame = frame.f_back
        if frame is None:
            continue
        caller = frame.f_locals.get("self")
        if frame.f_code is _RUNS_A_SESSION:
            if getattr(caller, "graph", None) is root:
                sessions.append(ident)
        elif id(getattr(caller, "_cached_graph", None)) in enclosing:
            return _native_id(ident)
    return _native_id(sessions[0]) if len(sessions) == 1 else 0


def _native_id(ident):
    return next((t.native_id for t in threading.enumerate() if t.ident == ident), 0)


def _dense(value, name):
    """`value` as a tensor. A ragged or sparse tensor is refused here,
    naming it: the core moves dense memory, and TensorFlow's own error for
    the conversion does not say which op or tensor it was."""
    if isinstance(value, tf.RaggedTensor):
        raise InvalidArgumentError("unison: tensor %s is a tf.RaggedTensor; pass a dense tensor (.to_tensor(), "
                                   "or its .flat_values)" % _label(name))
    if isinstance(value, tf.SparseTensor):
        raise InvalidArgumentError("unison: tensor %s is a tf.SparseTensor; pass a dense tensor "
                                   "(tf.sparse.to_dense)" % _label(name))
    return tf.convert_to_tensor(value)


def _tensors(values, name):
    values = list(values)
    return [_dense(v, n) for v, n in zip(values, _member_names(name, len(values)))]


_member_names = arguments.member_names


def _needs_gradient(tensors):
    """False when no gradient tape could want these tensors' gradients:
    eagerly with no tape watching them, the op skips tf.custom_gradient,
    which costs more than a small collective itself. Graphs always get the
    gradient (tracing cost is paid once)."""
    if not tf.executing_eagerly():
        return True
    try:
        return bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(list(tensors)))
    except Exception:  # noqa: BLE001 - a TensorFlow without this: always record
        return True


_CORE_OPS = {"allreduce": lib.UNISON_ALLREDUCE, "allgather": lib.UNISON_ALLGATHER, "broadcast": lib.UNISON_BROADCAST,
             "alltoall": lib.UNISON_ALLTOALL, "reducescatter": lib.UNISON_REDUCESCATTER}


def _kernel_attrs(kind, tensors, name, process_set, reduce_op=None, prescale_factor=1.0, postscale_factor=1.0,
                  root_rank=0):
    """{"kernel": the kernel op's function, "attrs": its attributes} for a
    node of `kind` on `tensors` in a graph with the compiled kernels
    loaded; {} where the node will be a py_function (eagerly too). What the
    Python node checks when it runs (names, factors, the root, the process
    set) is checked here, once, while tracing: the kernel only enqueues."""
    if _kernels is None or tf.executing_eagerly():
        return {}
    set_id = process_set_id(process_set)
    for t, n in zip(tensors, _member_names(name, len(tensors))):
        try:
            collective.prepare(_CORE_OPS[kind], n, dtypes.code_of(t.dtype.name, n), (), reduce_op or 0,
                               prescale_factor, postscale_factor, root_rank, None, set_id, -1)
        except InvalidArgumentError as error:
            translated = _as_tensorflow_error(error)
            if translated is None:
                raise
            raise translated from error
    attrs = {"process_set": set_id}
    if kind in ("allreduce", "reducescatter"):
        attrs.update(reduce_op=int(reduce_op), prescale_bits=_bits(prescale_factor),
                     postscale_bits=_bits(postscale_factor))
    if kind == "broadcast":
        attrs["root_rank"] = int(root_rank)
    return {"kernel": "unison_" + kind, "attrs": attrs}


def _bits(factor):
    """A factor as its double's bits: a float attr is 32 bits wide."""
    return struct.unpack("<q", struct.pack("<d", float(factor)))[0]


def _grouped_node(kind, tensors, name, start, static_shape, kernel=None, attrs=None):
    """One node for a grouped op: start(array, member name) enqueues each
    member and returns its Handle; all are enqueued before any is waited
    on, so the core fuses them. static_shape(t) is each output's shape as
    far as tracing knows it. In a graph with the compiled kernels loaded,
    the node is the kernel op `kernel` instead, with `attrs`."""
    names = _member_names(name, len(tensors))

    def fn(*arrays):
        return synchronize(HandleGroup([start(a, n) for a, n in zip(arrays, names)]))

    def compiled(core_names, awaited_by):
        return getattr(_kernels, kernel)(tensors, names=core_names, awaited_by=awaited_by, **attrs)
    outputs = _run(fn, tensors, [t.dtype for t in tensors], kind, name, compiled if kernel else None, names)
    for out, t in zip(outputs, tensors):
        out.set_shape(static_shape(t))
    return outputs


def _rows_unknown(t):
    return tf.TensorShape([None]).concatenate(t.shape[1:])


def _zeros_for_missing(grads, like):
    return [tf.zeros_like(x) if g is None else g for g, x in zip(grads, like)]


class _TensorFlowGradients(gradients.GradientOps):
    """unison.gradients' building blocks as TensorFlow collectives (graph
    nodes inside a tf.function), themselves differentiable."""

    def grouped_allreduce(self, tensors, op, prescale_factor, postscale_factor, process_set, name):
        return _grouped_allreduce(list(tensors), _member_names(name, len(tensors)) if name else None, op,
                                  prescale_factor, postscale_factor, process_set)

    def grouped_allgather(self, tensors, process_set, name):
        return _grouped_allgather_raw(list(tensors), name, process_set)

    def alltoall(self, tensor, splits, process_set, name):
        return _alltoall_raw(tensor, splits, name, process_set)[0]

    def my_rows(self, tensor, process_set, name):
        dims = _first_dims(tensor, name, process_set)
        rank = process_set.rank()
        return tf.reduce_sum(dims[:rank]), dims[rank]

    def narrow(self, tensor, start, length):
        return tensor[start:start + length]

    def scale(self, tensor, factor):
        return tensor * tf.constant(factor, dtype=tensor.dtype)

    def zeros_like(self, tensor):
        # Zeros that still need `tensor`: a broadcast's gradient is zero off
        # the root, but its allreduce must run on every rank, and a TF1
        # session would otherwise leave it out there (tf.zeros_like of a
        # known shape reads nothing), while the root waited for it.
        with tf.control_dependencies([tensor]):
            return tf.zeros_like(tensor)


_grads = _TensorFlowGradients()


# ---- allreduce ----------------------------------------------------------------

def _grouped_allreduce_raw(tensors, name, op, prescale_factor, postscale_factor, process_set):
    return _grouped_node("allreduce", tensors, name, lambda a, n: _front.allreduce_async(
        a, n, op, prescale_factor, postscale_factor, process_set), lambda t: t.shape,
        **_kernel_attrs("allreduce", tensors, name, process_set, reduce_op=op,
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def _grouped_allreduce(tensors, name, op, prescale_factor, postscale_factor, process_set):
    names = _member_names(name, len(tensors))
    for t, n in zip(tensors, names):
        _check(t, n)
        arguments.check_reduce("allreduce", op, prescale_factor, postscale_factor, n)
    if not _needs_gradient(tensors):
        return _grouped_allreduce_raw(list(tensors), name, op, prescale_factor, postscale_factor, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allreduce_raw(list(xs), name, op, prescale_factor, postscale_factor, process_set)

        def grad(*dys):
            return gradients.allreduce(_grads, _zeros_for_missing(dys, ys), op, prescale_factor,
                                       postscale_factor, process_set, _group_label(name))
        return ys, grad
    return list(forward(*tensors))


def _grouped_allreduce_with_stand_ins(tensors, names, stand_ins, op, prescale_factor, postscale_factor,
                                      process_set):
    """Eagerly, a grouped allreduce in which the tensors marked in
    `stand_ins` are zeros standing in for gradients this rank does not have
    (frontend.allreduce_placeholder_async_). Each result is the reduction,
    or None where every rank's tensor was a stand-in."""
    for t, n in zip(tensors, names):
        _check(t, n)
        arguments.check_reduce("allreduce", op, prescale_factor, postscale_factor, n)
    arrays = [np.zeros(t.shape, t.dtype.as_numpy_dtype) if stands_in else _view(t)
              for t, stands_in in zip(tensors, stand_ins)]
    try:
        results = synchronize(_front.grouped_allreduce_async(arrays, names, op, prescale_factor, postscale_factor,
                                                             process_set, placeholders=list(stand_ins)))
    except (MismatchError, InvalidArgumentError) as error:
        translated = _as_tensorflow_error(error)
        if translated is None:
            raise
        raise translated from error
    return [None if r is None else _to_tensor(r, t.dtype) for r, t in zip(results, tensors)]


def _group_label(name):
    """One name for a group whose members may be named one by one."""
    if isinstance(name, (list, tuple)):
        return None if any(n is None for n in name) else "|".join(name)
    return name


def _sparse_allreduce(slices, name, op, prescale_factor, postscale_factor, process_set):
    """IndexedSlices are reduced as Horovod does: both parts allgathered,
    so a row touched on several ranks appears several times (summed when
    densified)."""
    # As Horovod: only Sum and Average have a meaning for rows that may
    # repeat, and the factors are not offered.
    if op not in (Sum, Average):
        raise NotImplementedError("unison: IndexedSlices %s can be reduced with Sum or Average only, not %s"
                                  % (_label(name), arguments.op_name(op)))
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("unison: IndexedSlices %s take no prescale or postscale factor" % _label(name))
    values = allgather(slices.values, name=None if name is None else name + ".values", process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else name + ".indices",
                        process_set=process_set)
    if op == Average:
        size = tf.constant(process_set.size(), dtype=values.dtype)
        # Integer values divide as the core's Average does: toward zero.
        values = values / size if values.dtype.is_floating else tf.truncatediv(values, size)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _xla_reduces_dense():
    """True when traced into a function XLA compiles, with allreduce lowered
    to it: an IndexedSlices (a sparse gradient) is then reduced dense, as
    sparse_as_dense does. XLA holds every tensor dense, and allgather,
    Horovod's way for IndexedSlices, has no XLA lowering."""
    return not tf.executing_eagerly() and \
        control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()) and not xla_refusal()


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False):
    """`tensor` reduced across the ranks of the process set (Average by default, as in
    Horovod); an IndexedSlices (a sparse gradient) is allgathered instead, but for being
    reduced dense under XLA. Eager, in a tf.function (jit_compile=True included, on the
    CPU) and in a TF1 graph alike. Differentiable.

    Args:
        tensor: a tf.Tensor, variable value or IndexedSlices, the same shape and dtype on every rank.
        average: Horovod's older flag (True: Average, False: Sum); `op` replaces it.
        device_dense: Horovod's; accepted and unused (the tensor's own device is used).
        device_sparse: Horovod's; accepted and unused.
        compression: Compression.none or Compression.fp16.
        op: Average, Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        ignore_name_scope: Horovod's; names here are never prefixed with the name scope.
        process_set: the ranks that take part; every rank by default.

    Raises:
        tf.errors.FailedPreconditionError: ranks gave the same name different shapes, dtypes or
            arguments; eagerly it is also a unison.MismatchError, naming the tensor, the ranks and
            what each sent.
        tf.errors.InvalidArgumentError: an argument this collective cannot take (also a
            unison.InvalidArgumentError eagerly), on the rank that gave it.
        tf.errors.AbortedError: a rank of the set died or shut unison down (eagerly
            unison.RankFailedError or ShutDownError, both HorovodInternalError).
    """
    op = arguments.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if not _xla_reduces_dense():
            return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
        tensor = tf.convert_to_tensor(tensor)
    tensor = _dense(tensor, name)
    wire, ctx = compression.compress(tensor)
    reduced = _grouped_allreduce([wire], name, op, prescale_factor, postscale_factor, process_set)[0]
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      name=None, process_set=global_process_set, ignore_name_scope=False):
    """Each tensor of `tensors` reduced across the ranks, in one node, so that they are
    negotiated and fused together. Takes allreduce's arguments, for the whole list, and raises
    what it raises. Differentiable.
    """
    op = arguments.resolve_op(op, average)
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors) and not _xla_reduces_dense():
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, name=arguments.member_name(name, i),
                          process_set=process_set)
                for i, t in enumerate(tensors)]
    wires, ctxs = zip(*[compression.compress(t) for t in _tensors(tensors, name)])
    reduced = _grouped_allreduce(list(wires), name, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


# ---- allgather ----------------------------------------------------------------

def _first_dims(tensor, name, process_set):
    """Every rank's first dimension, in rank order, as an int64 vector."""
    d = tf.reshape(tf.cast(tf.shape(tensor)[0], tf.int64), [1])
    return _grouped_allgather_raw([d], None if name is None else name + ".dims", process_set)[0]


def _grouped_allgather_raw(tensors, name, process_set):
    return _grouped_node("allgather", tensors, name, lambda a, n: _front.allgather_async(a, n, process_set),
                         _rows_unknown, **_kernel_attrs("allgather", tensors, name, process_set))


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Each tensor concatenated across ranks on the first dimension, which
    may differ between ranks. Differentiable."""
    tensors = _tensors(tensors, name)
    if not tensors:
        return []
    for t, n in zip(tensors, _member_names(name, len(tensors))):
        _check(t, n)
        arguments.check_has_rows("allgather", tuple(t.shape), n)
    if not _needs_gradient(tensors):
        return _grouped_allgather_raw(tensors, name, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allgather_raw(list(xs), name, process_set)

        def grad(*dys):
            return gradients.allgather(_grads, _zeros_for_missing(dys, ys), xs, process_set, _group_label(name))
        return ys, grad
    return list(forward(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, in rank order.
    Differentiable: the gradient is this rank's rows of the allreduced incoming gradient.

    Args:
        tensor: a tensor whose first dimension may differ between ranks; its other dimensions and
            its dtype must not.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        ignore_name_scope: Horovod's; names here are never prefixed with the name scope.
        process_set: the ranks that take part; every rank by default.

    Raises what allreduce raises.
    """
    return grouped_allgather([tensor], name=name, process_set=process_set)[0]


# ---- broadcast ----------------------------------------------------------------

def _broadcast_raw(tensors, root_rank, name, process_set):
    return _grouped_node("broadcast", tensors, name, lambda a, n: _front.broadcast_async(a, root_rank, n, process_set),
                         lambda t: t.shape,
                         **_kernel_attrs("broadcast", tensors, name, process_set, root_rank=root_rank))


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """root_rank's `tensor` on every rank of the process set. Differentiable: the root gets
    the rank-averaged gradient, the other ranks zeros, as in Horovod.

    Args:
        tensor: the same shape and dtype on every rank (only the root's values are read).
        root_rank: the global rank that sends; it must be in the process set.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        ignore_name_scope: Horovod's; names here are never prefixed with the name scope.
        process_set: the ranks that take part; every rank by default.

    Raises what allreduce raises, and InvalidArgumentError for a root_rank outside the process set.
    """
    tensor = _dense(tensor, name)
    _check(tensor, name)
    if not _needs_gradient([tensor]):
        return _broadcast_raw([tensor], root_rank, name, process_set)[0]

    @tf.custom_gradient
    def forward(x):
        y = _broadcast_raw([x], root_rank, name, process_set)[0]

        def grad(dy):
            return gradients.broadcast(_grads, [dy], root_rank, process_set, name)[0]
        return y, grad
    return forward(tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrites each variable with root_rank's value, in place (one node
    for all of them); returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    values = [tf.convert_to_tensor(v) for v in variables]
    for v, t in zip(variables, values):
        _check(t, getattr(v, "name", name))
    received = _broadcast_raw(values, root_rank, name, process_set)
    return [v.assign(r) for v, r in zip(variables, received)]


# ---- alltoall -----------------------------------------------------------------

def _alltoall_raw(tensor, splits, name, process_set):
    """(output, received splits)."""
    def fn(array, split_array):
        out, received = synchronize(_front.alltoall_async(array, split_array, name, process_set))
        return out, np.asarray(received, dtype=np.int64)
    if splits is None:
        # Equal parts, as Horovod: a first dimension that does not divide is
        # refused (statically when tracing knows it, else when it runs).
        n = process_set.size()
        rows = tensor.shape[0]
        if rows is not None and rows % n:
            raise _InvalidArgument(None, None, "unison: alltoall of %s: first dimension %d does not divide "
                                   "evenly among %d ranks; pass splits" % (_label(name), rows, n))
        rows = tf.shape(tensor, out_type=tf.int64)[0]
        splits = tf.fill([n], rows // n)
    inputs = [tensor, tf.cast(splits, tf.int64)]
    compiled = None
    if _kernels is not None and not tf.executing_eagerly():
        attrs = _kernel_attrs("alltoall", [tensor], name, process_set)["attrs"]
        compiled = (lambda core_names, awaited_by: _kernels.unison_alltoall(
            inputs[0], inputs[1], names=core_names, awaited_by=awaited_by, **attrs))
    output, received = _run(fn, inputs, [tensor.dtype, tf.int64], "alltoall", name, compiled, [name])
    output.set_shape(_rows_unknown(tensor))
    received.set_shape([process_set.size()])
    return output, received


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Sends rows `splits[i]` of `tensor` to rank i and returns what every rank sent here, in
    rank order. Differentiable: the gradient goes back by the reverse alltoall.

    Args:
        tensor: the rows to scatter, dtype and trailing dimensions the same on every rank.
        splits: how many rows go to each rank of the set; where None, equal parts.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        ignore_name_scope: Horovod's; names here are never prefixed with the name scope.
        process_set: the ranks that take part; every rank by default.

    Returns:
        The received rows; with `splits`, also how many came from each rank.

    Raises what allreduce raises.
    """
    tensor = _dense(tensor, name)
    _check(tensor, name)
    arguments.check_has_rows("alltoall", tuple(tensor.shape), name)
    split_tensor = None if splits is None else tf.reshape(tf.convert_to_tensor(splits), [-1])
    if split_tensor is not None and not split_tensor.dtype.is_integer:
        raise InvalidArgumentError("unison: alltoall of %s: splits must be integers, got %s"
                                   % (_label(name), split_tensor.dtype.name))
    split_dtype = split_tensor.dtype if split_tensor is not None else tf.int32

    @tf.custom_gradient
    def forward(x):
        y, received = _alltoall_raw(x, split_tensor, name, process_set)

        def grad(dy, _d_received=None):
            return gradients.alltoall(_grads, dy, received, process_set, name)
        return (y, tf.cast(received, split_dtype)), grad

    if _needs_gradient([tensor]):
        output, received = forward(tensor)
    else:
        output, received = _alltoall_raw(tensor, split_tensor, name, process_set)
        received = tf.cast(received, split_dtype)
    return (output, received) if splits is not None else output


# ---- reducescatter ------------------------------------------------------------

def _grouped_reducescatter_raw(tensors, name, op, prescale_factor, postscale_factor, process_set):
    size, rank = process_set.size(), process_set.rank()

    def static_shape(t):
        rows = t.shape[0]
        mine = None if rows is None else arguments.scatter_rows(rows, size, rank)
        return tf.TensorShape([mine]).concatenate(t.shape[1:])
    return _grouped_node("reducescatter", tensors, name, lambda a, n: _front.reducescatter_async(
        a, n, op, prescale_factor, postscale_factor, process_set), static_shape,
        **_kernel_attrs("reducescatter", tensors, name, process_set, reduce_op=op,
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def grouped_reducescatter(tensors, op=Average, name=None, ignore_name_scope=False,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Each tensor reduced across ranks; this rank keeps its rows of the
    first dimension (split as evenly as possible, the first ranks taking
    one more). Differentiable."""
    tensors = _tensors(tensors, name)
    if not tensors:
        return []
    for t, n in zip(tensors, _member_names(name, len(tensors))):
        _check(t, n)
        arguments.check_reduce("reducescatter", op, prescale_factor, postscale_factor, n)
        arguments.check_has_rows("reducescatter", tuple(t.shape), n)
    if not _needs_gradient(tensors):
        return _grouped_reducescatter_raw(tensors, name, op, prescale_factor, postscale_factor, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_reducescatter_raw(list(xs), name, op, prescale_factor, postscale_factor, process_set)

        def grad(*dys):
            return gradients.reducescatter(_grads, _zeros_for_missing(dys, ys), op, prescale_factor,
                                           postscale_factor, process_set, _group_label(name))
        return ys, grad
    return list(forward(*tensors))


def reducescatter(tensor, op=Average, name=None, ignore_name_scope=False, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` across the process set and returns this rank's rows of the result:
    the first dimension split as evenly as possible, the first ranks taking one more row when it
    does not divide. Differentiable.

    Args:
        tensor: the same shape and dtype on every rank.
        op: Average (the default) or Sum.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        ignore_name_scope: Horovod's; names here are never prefixed with the name scope.
        process_set: the ranks that take part; every rank by default.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.

    Raises what allreduce raises.
    """
    return grouped_reducescatter([tensor], op=op, name=name, process_set=process_set,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)[0]


# ---- barrier and join -----------------------------------------------------------

def barrier(process_set=global_process_set):
    """Returns once every rank has reached it. Inside a graph it is a node:
    a tf.function runs it in its place; in a TF1 graph it is returned, as
    Horovod's op is, for the session to run."""
    def fn():
        collective.barrier(process_set)
        return [np.int32(0)]

    def compiled(core_names, awaited_by):
        return [_kernels.unison_barrier(names=core_names, process_set=process_set_id(process_set),
                                        awaited_by=awaited_by)]
    outputs = _run(fn, [], [tf.int32], "barrier", _NO_TENSOR, compiled)
    return None if tf.executing_eagerly() else outputs[0].op


def join(process_set=global_process_set):
    """Declares this rank out of data (it takes part in the others'
    collectives with nothing) and returns the rank that joined last."""
    def fn():
        return [np.int32(collective.join(process_set))]

    def compiled(core_names, awaited_by):
        return [_kernels.unison_join(names=core_names, process_set=process_set_id(process_set),
                                     awaited_by=awaited_by)]
    return _run(fn, [], [tf.int32], "join", _NO_TENSOR, compiled)[0]


# ---- queries as ops ----------------------------------------------------------------

def _constant_op(value, name):
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name=None):
    """This rank, as an int32 tensor (Horovod's graph-mode query)."""
    return _constant_op(basics.rank(), name)


def local_rank_op(name=None):
    """This rank's local rank, as an int32 tensor (Horovod's graph-mode query)."""
    return _constant_op(basics.local_rank(), name)


def size_op(process_set_id=0, name=None):
    """The size of process set `process_set_id` (0: the job), as an int32 tensor."""
    return _constant_op(_process_set_by_id(process_set_id).size(), name)


def local_size_op(name=None):
    """The number of ranks on this host, as an int32 tensor."""
    return _constant_op(basics.local_size(), name)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank belongs to the process set, else 0."""
    return _constant_op(int(_process_set_by_id(process_set_id).included()), name)


def _process_set_by_id(process_set_id):
    from unison.process_sets import find
    return find(process_set_id)


# The compiled kernels (kernels.py), or None: graph nodes are then
# py_function nodes. Loaded last, since they call back into _find_waiter.
_kernels = _kernel_library.load(_find_waiter)
