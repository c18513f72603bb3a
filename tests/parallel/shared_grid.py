"""The one test grid every front end runs: each collective x dtype x shape
(zero-size, scalar and odd shapes always among them) x each form the front
end offers (sync, async, in place, grouped, tf.function), Adasum, each
collective on a process set, and random programs of many asynchronous ops
in flight at once, started and waited for in a different order on each
rank, with exact values: every rank computes what every other rank sent.

A front end joins with a file of a few lines, test_<framework>_grid.py:

    from shared_grid import *   # the tests below, and pytest_generate_tests
    SHIM = MyShim()             # a Shim: how to make its tensors and read them back

tests/test_parallel.py runs each such file at 1, 2 and 3 ranks, and
tests/test_mpi.py runs the numpy one on every MPI layout.
"""
import inspect
import itertools
import re
import time

import numpy as np
import pytest

import unison
from unison import objects

try:
    import ml_dtypes  # numpy's bfloat16
except ImportError:  # the mxnet env's numpy is too old for it, and MXNet has no bfloat16
    ml_dtypes = None

OPS = ["Sum", "Average", "Min", "Max", "Product"]
SHAPES = [(0,), (), (1,), (17,), (3, 4, 5)]
ROW_SHAPES = [(0, 3), (1,), (5,), (3, 4, 5)]  # ops that need a first dimension
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]   # moved by every op, reduced by Sum and Average


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class Shim:
    """What the grid needs from a front end, written once for Horovod's API:
    `api` is the module whose allreduce, allreduce_, allreduce_async, ...
    the grid calls, and every form the module has (sync, async, in place,
    grouped, ...) is run. A front end's shim says how to make its tensors
    from a numpy array (`tensor`) and read them back (`numpy`), which
    dtypes it has, and overrides a *_forms method where its forms differ
    (TensorFlow's eager and tf.function). Each *_forms() is {form name:
    function}; the grid runs every form."""
    name = "?"
    api = None               # the front-end module: the ops, Sum, Average, ..., Adasum and process sets
    program_seeds = None     # the random programs to run (None: every one of PROGRAM_SEEDS)
    dtypes = []              # dtype names every byte-moving op takes
    reduce_dtypes = []       # dtype names allreduce and reducescatter take

    def tensor(self, array):
        raise NotImplementedError

    def numpy(self, tensor):
        raise NotImplementedError

    def ps(self, process_set):
        return unison.global_process_set if process_set is None else process_set  # one object for every front end

    def _has(self, *names):
        return all(hasattr(self.api, n) for n in names)

    def allreduce_forms(self):
        """{form: f(x, op, name, prescale, postscale, process_set) -> tensor}"""
        api, ps = self.api, self.ps

        def options(op, name, pre, post, process_set):
            return dict(op=op, name=name, prescale_factor=pre, postscale_factor=post, process_set=ps(process_set))

        def in_place(x, *args):
            assert api.allreduce_(x, **options(*args)) is x
            return x

        def in_place_async(x, *args):
            assert api.synchronize(api.allreduce_async_(x, **options(*args))) is x
            return x

        def grouped_in_place(x, *args):
            api.grouped_allreduce_([x], **options(*args))
            return x
        forms = {"sync": lambda x, *args: api.allreduce(x, **options(*args)),
                 "async": lambda x, *args: api.synchronize(api.allreduce_async(x, **options(*args))),
                 "in_place": in_place, "in_place_async": in_place_async,
                 "grouped": lambda x, *args: api.grouped_allreduce([x], **options(*args))[0],
                 "grouped_in_place": grouped_in_place}
        needs = {"sync": ["allreduce"], "async": ["allreduce_async"], "in_place": ["allreduce_"],
                 "in_place_async": ["allreduce_async_"], "grouped": ["grouped_allreduce"],
                 "grouped_in_place": ["grouped_allreduce_"]}
        return {form: f for form, f in forms.items() if self._has(*needs[form])}

    def allreduce_step_forms(self):
        """{form: f(xs, ops, names) -> [tensor]}: a training step's
        allreduces, xs[i] reduced by ops[i] as names[i], one after another;
        in place where the front end has in-place forms, as a step's
        gradients are. Eagerly that is one call per tensor; a shim whose
        form builds a graph per call builds one graph for the whole step
        instead, and runs it again at the next step, as a traced training
        step is run."""
        forms = self.allreduce_forms()
        forms = {form: f for form, f in forms.items() if "in_place" in form} or forms

        def step(allreduce):
            return lambda xs, ops, names: [allreduce(x, op, name, 1.0, 1.0, None) for x, op, name in zip(xs, ops, names)]
        return {form: step(allreduce) for form, allreduce in forms.items()}

    def grouped_allreduce(self, xs, op, name, process_set):
        return self.api.grouped_allreduce(xs, op=op, name=name, process_set=self.ps(process_set))

    def allgather_forms(self):
        """{form: f(x, name, process_set) -> tensor}"""
        api, ps = self.api, self.ps
        forms = {"sync": lambda x, name, p: api.allgather(x, name=name, process_set=ps(p))}
        if self._has("allgather_async"):
            forms["async"] = lambda x, name, p: api.synchronize(api.allgather_async(x, name=name, process_set=ps(p)))
        return forms

    def grouped_allgather(self, xs, name, process_set):
        return self.api.grouped_allgather(xs, name=name, process_set=self.ps(process_set))

    def broadcast_forms(self):
        """{form: f(x, root, name, process_set) -> tensor}"""
        api, ps = self.api, self.ps

        def in_place(x, root, name, p):
            assert api.broadcast_(x, root, name=name, process_set=ps(p)) is x
            return x
        forms = {"sync": lambda x, root, name, p: api.broadcast(x, root, name=name, process_set=ps(p)),
                 "in_place": in_place}
        if self._has("broadcast_async"):
            forms["async"] = lambda x, root, name, p: api.synchronize(
                api.broadcast_async(x, root, name=name, process_set=ps(p)))
        return forms

    def broadcast_every_root_forms(self):
        """{form: f(xs, names, process_set) -> [tensor]}: xs[r] broadcast
        from root r as names[r], one root after another. Eagerly that is one
        call per root; a shim whose form builds a graph per call (a traced
        function, a compiled one) builds one graph holding every root's
        broadcast instead, which asserts the same values at a third of the
        builds at 3 ranks."""
        def every_root(broadcast):
            return lambda xs, names, p: [broadcast(x, root, name, p) for root, (x, name) in enumerate(zip(xs, names))]
        return {form: every_root(broadcast) for form, broadcast in self.broadcast_forms().items()}

    def alltoall(self, x, splits, name, process_set):
        """(output, received splits as a list of ints)"""
        out, received = self.api.alltoall(x, splits=splits, name=name, process_set=self.ps(process_set))
        return out, [int(s) for s in self.numpy(received).tolist()]

    def alltoall_even(self, x, name, process_set):
        """The output alone, as Horovod returns it without splits."""
        return self.api.alltoall(x, name=name, process_set=self.ps(process_set))

    def reducescatter_forms(self):
        """{form: f(x, op, name, process_set) -> tensor}"""
        api, ps = self.api, self.ps
        forms = {"sync": lambda x, op, name, p: api.reducescatter(x, op=op, name=name, process_set=ps(p))}
        if self._has("reducescatter_async"):
            forms["async"] = lambda x, op, name, p: api.synchronize(
                api.reducescatter_async(x, op=op, name=name, process_set=ps(p)))
        return forms

    def _takes(self, function, keyword):
        return self._has(function) and keyword in inspect.signature(getattr(self.api, function)).parameters

    def reducescatter_split(self, x, op, splits, name, process_set, output=None):
        """reducescatter with each rank's rows given, into `output` where one
        is given (front ends that take splits= and output=, see _takes)."""
        extra = {} if output is None else {"output": output}
        return self.api.synchronize(self.api.reducescatter_async(x, op=op, name=name, process_set=self.ps(process_set),
                                                                 splits=splits, **extra))

    def allgather_into(self, x, output, name, process_set):
        """allgather into the caller's `output` (front ends that take output=)."""
        return self.api.synchronize(self.api.allgather_async(x, name=name, process_set=self.ps(process_set),
                                                             output=output))

    def grouped_reducescatter(self, xs, op, name, process_set):
        return self.api.grouped_reducescatter(xs, op=op, name=name, process_set=self.ps(process_set))

    def barrier(self, process_set):
        self.api.barrier(process_set=self.ps(process_set))


def pytest_generate_tests(metafunc):
    shim = metafunc.module.SHIM
    axes = {"fw": ([shim], [shim.name]), "op": (OPS, OPS), "shape": (SHAPES, None), "row_shape": (ROW_SHAPES, None),
            "dtype": (shim.dtypes, None), "reduce_dtype": (shim.reduce_dtypes, None),
            "float_dtype": ([d for d in FLOATS if d in shim.reduce_dtypes], None),
            "complex_dtype": ([d for d in COMPLEX if d in shim.dtypes], None),
            # One seed for a front end without asynchronous forms: the test says why it skips, once.
            "program_seed": ((shim.program_seeds or PROGRAM_SEEDS) if shim._has("allreduce_async", "synchronize")
                             else [0], None)}
    for argument, (values, ids) in axes.items():
        if argument not in metafunc.fixturenames:
            continue
        if not values:   # a framework without the type (MXNet has no complex dtype)
            skip = pytest.mark.skip(reason="%s has no %s" % (shim.name, argument.replace("_", " ")))
            metafunc.parametrize(argument, [pytest.param(None, marks=skip)], ids=["none"])
        else:
            metafunc.parametrize(argument, values, ids=ids or [str(v) for v in values])


# ---- values ------------------------------------------------------------------------

def rank_values(shape, dtype, rank):
    """Small integers that differ per rank and per element: exact in every dtype."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return ((np.arange(n) + rank) % 2 == 0).reshape(shape)
    if dtype in COMPLEX:   # the imaginary parts differ from the real ones, and by rank
        return ((np.arange(n) % 5) + rank + 1 + 1j * ((np.arange(n) % 3) - rank)).astype(dtype).reshape(shape)
    return ((np.arange(n) % 5) + rank + 1).astype(np_dtype(dtype)).reshape(shape)


def reduced(op, inputs, dtype, ranks):
    """What op gives over `inputs` in `dtype`: integers wrap and their
    Average truncates, as the frameworks' own integer tensors do."""
    integer = np.issubdtype(np_dtype(dtype), np.integer)
    wide = np.int64 if integer else np.complex128 if dtype in COMPLEX else np.float64
    combine = {"Sum": np.add, "Average": np.add, "Product": np.multiply, "Min": np.minimum, "Max": np.maximum}[op]
    # Combined in rank order into one wide array, each input cast as the
    # ufunc reads it (as astype(wide) would, uint64 included): no wide copy
    # of each input. A random program's tensors have up to 300,000 elements,
    # and ThreadSanitizer checks every byte numpy copies.
    out = np.array(inputs[0], dtype=wide)
    for x in inputs[1:]:
        combine(out, x, out=out, dtype=wide, casting="unsafe")
    if op == "Average":
        if integer:
            out = np.trunc(out / ranks).astype(np.int64)
        elif dtype in COMPLEX:   # each part by the count: numpy's complex division by 3+0j can round differently
            out = out.real / ranks + 1j * (out.imag / ranks)
        else:
            out = out / ranks
    return out.astype(np_dtype(dtype))


def assert_same(got, expected, err_msg=""):
    """np.testing.assert_array_equal's verdict, at a fraction of its cost
    where the arrays are equal, as they are in a passing run. It checks
    each element twice (NaNs, infinities, then the rest), copying the
    arrays to do so: 10% of a ThreadSanitizer run, whose runtime checks
    every byte numpy copies. Equal shapes whose elements all compare
    equal pass it; anything else (a NaN, a broadcast scalar, a difference)
    goes to it, for its verdict and its message."""
    a, b = np.asarray(got), np.asarray(expected)
    if a.shape == b.shape and bool(np.all(a == b)):
        return
    np.testing.assert_array_equal(got, expected, err_msg=err_msg)


def assert_exact(fw, tensor, expected):
    got = fw.numpy(tensor)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    # Same dtype and shape: == compares exactly. Only a mismatch pays for
    # widening (numpy's report cannot print bfloat16).
    if bool(np.all(got == expected)):
        return
    wide = np.complex128 if np.iscomplexobj(expected) else np.float64
    np.testing.assert_array_equal(got.astype(wide), expected.astype(wide))


def subset():
    """A process set of this rank and some others: the lower or upper half
    of the job, or at one rank the global set. Every rank adds both halves,
    as add_process_set requires; the caller removes them with forget()."""
    n = unison.size()
    if n == 1:
        return unison.global_process_set, []
    low = unison.add_process_set(list(range(n // 2)))
    high = unison.add_process_set(list(range(n // 2, n)))
    return (low if low.included() else high), [low, high]


@pytest.fixture(scope="module")
def part():
    process_set, added = subset()
    yield process_set
    for s in added:
        unison.remove_process_set(s)


def tag(*parts):
    return ".".join(str(p) for p in parts)


# ---- allreduce ---------------------------------------------------------------------

def test_allreduce_every_op_dtype_shape(fw, op, reduce_dtype, shape):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values(shape, reduce_dtype, r) for r in range(n)]
    sync = next(iter(fw.allreduce_forms().values()))
    out = sync(fw.tensor(inputs[me]), getattr(fw.api, op), tag("ar", op, reduce_dtype, shape), 1.0, 1.0, None)
    assert_exact(fw, out, reduced(op, inputs, reduce_dtype, n))


def test_complex_tensors_reduce_by_sum_and_average_in_every_form(fw, complex_dtype):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values((2, 3), complex_dtype, r) for r in range(n)]
    for op in ["Sum", "Average"]:
        for form, allreduce in fw.allreduce_forms().items():
            out = allreduce(fw.tensor(inputs[me]), getattr(fw.api, op), tag("cx", form, op, complex_dtype),
                            1.0, 1.0, None)
            assert_exact(fw, out, reduced(op, inputs, complex_dtype, n))
        sync = next(iter(fw.allreduce_forms().values()))
        out = sync(fw.tensor(inputs[me]), getattr(fw.api, op), tag("cx.scaled", op, complex_dtype), 2.0, 0.25, None)
        assert_exact(fw, out, (reduced(op, inputs, "complex128", n) * 0.5).astype(complex_dtype))
        counts = [2 // n + (1 if r < 2 % n else 0) for r in range(n)]
        start = sum(counts[:me])
        for form, reducescatter in fw.reducescatter_forms().items():
            out = reducescatter(fw.tensor(inputs[me]), getattr(fw.api, op), tag("cx.rs", form, op, complex_dtype),
                                None)
            assert_exact(fw, out, reduced(op, inputs, complex_dtype, n)[start:start + counts[me]])


def test_complex_tensors_refuse_min_max_product_and_adasum_on_every_rank_naming_the_tensor(fw, complex_dtype):
    x = rank_values((3,), complex_dtype, unison.rank())
    sync = next(iter(fw.allreduce_forms().values()))
    for op in ["Min", "Max", "Product"]:
        with pytest.raises(unison.InvalidArgumentError,
                           match=r"'cx\.%s': %s tensors reduce by Sum or Average, not %s" % (op, complex_dtype, op)):
            sync(fw.tensor(x), getattr(fw.api, op), "cx." + op, 1.0, 1.0, None)
    with pytest.raises(unison.InvalidArgumentError, match="'cx.adasum': Adasum needs a floating-point tensor"):
        sync(fw.tensor(x), fw.api.Adasum, "cx.adasum", 1.0, 1.0, None)
    assert_exact(fw, sync(fw.tensor(x), fw.api.Sum, "cx.after", 1.0, 1.0, None),
                 reduced("Sum", [rank_values((3,), complex_dtype, r) for r in range(unison.size())], complex_dtype,
                         unison.size()))


def test_join_in_a_loop_then_allgather_object(fw):
    """Horovod's join test as a loop: in each pass one rank joins at once,
    the others allreduce two names (started together where the front end
    has async ops), then join, and every rank gathers what join() returned.
    Each pass is a join that ends while the next op is being taken: ranks
    once took that op at different cycles, one sending it in full and one
    by cache bit, and both waited for good (2 runs in 8 of Horovod's test)."""
    n, me = unison.size(), unison.rank()
    gather = getattr(fw.api, "allgather_object", None) or objects.allgather_object
    allreduce = next(iter(fw.allreduce_forms().values()))
    dtypes = [d for d in ["int32", "int64", "float32", "float64"] if d in fw.reduce_dtypes]
    for dtype, dims, first, warm in itertools.product(dtypes, [1, 2, 3], range(n), [False, True]):
        inputs = {"join.a": [np.full((5,) * dims, r + 1, np_dtype(dtype)) for r in range(n)],
                  "join.b": [np.full((17,) * dims, r + 1, np_dtype(dtype)) for r in range(n)]}
        if warm:  # every rank, before anyone joins: the names are then in the response cache
            for name, values in inputs.items():
                assert_exact(fw, allreduce(fw.tensor(values[me]), fw.api.Sum, name, 1.0, 1.0, None),
                             reduced("Sum", values, dtype, n))
        if me != first:
            # The rank that joined adds zeros.
            expected = {name: reduced("Sum", [v if r != first else 0 * v for r, v in enumerate(values)], dtype, n)
                        for name, values in inputs.items()}
            if hasattr(fw.api, "allreduce_async"):
                handles = {name: fw.api.allreduce_async(fw.tensor(values[me]), op=fw.api.Sum, name=name)
                           for name, values in inputs.items()}
                outs = {name: fw.api.synchronize(handle) for name, handle in handles.items()}
            else:
                outs = {name: allreduce(fw.tensor(values[me]), fw.api.Sum, name, 1.0, 1.0, None)
                        for name, values in inputs.items()}
            for name, out in outs.items():
                assert_exact(fw, out, expected[name])
        last = int(fw.api.join())
        assert 0 <= last < n and (last != first or n == 1), (last, first)
        assert gather(last) == [last] * n, (dtype, dims, first, warm)


def test_allreduce_every_form(fw, reduce_dtype):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values((2, 3), reduce_dtype, r) for r in range(n)]
    for form, allreduce in fw.allreduce_forms().items():
        for op in ["Sum", "Max"]:
            out = allreduce(fw.tensor(inputs[me]), getattr(fw.api, op), tag("arf", form, op, reduce_dtype),
                            1.0, 1.0, None)
            assert_exact(fw, out, reduced(op, inputs, reduce_dtype, n))


def test_in_place_allreduce_repeated_step_after_step(fw, reduce_dtype):
    """A training step allreduces each gradient in place under the same
    name as the step before, so a front end starts a repeat from what it
    kept of the op's first call (the prepared options of
    frontend.FrontEnd.allreduce_async_; in unison.torch, the compiled
    path of fast_path.cc): every repeat must reduce this step's values, in
    this call's tensor. A framework without in-place forms (TensorFlow)
    repeats its out-of-place ones, whose options its front end keeps too.
    Each step here reduces a tensor of each shape by Sum and by Max."""
    n, me = unison.size(), unison.rank()
    calls = [(shape, op) for shape in [(), (0,), (7,), (2, 3)] for op in ["Sum", "Max"]]
    ops = [getattr(fw.api, op) for _, op in calls]
    for form, run_step in fw.allreduce_step_forms().items():
        names = [tag("step", form, op, reduce_dtype, shape) for shape, op in calls]
        for step in range(3):
            inputs = [[rank_values(shape, reduce_dtype, r + step) for r in range(n)] for shape, _ in calls]
            outs = run_step([fw.tensor(x[me]) for x in inputs], ops, names)
            assert len(outs) == len(calls)
            for (shape, op), x, out in zip(calls, inputs, outs):
                assert_exact(fw, out, reduced(op, x, reduce_dtype, n))


def test_one_name_reused_with_another_dtype_shape_op_scale_or_set(fw, part):
    """Front ends keep each distinct op's checked options for its repeats
    (frontend.FrontEnd.allreduce_async_): a name reused with anything else
    changed must run as the new op, and the old one must still run as it
    was. Unnamed ops too."""
    n, me = unison.size(), unison.rank()
    float_dtype = "float32" if "float32" in fw.reduce_dtypes else fw.reduce_dtypes[0]
    int_dtype = "int32" if "int32" in fw.reduce_dtypes else fw.reduce_dtypes[-1]
    cases = [(float_dtype, (3,), "Sum", 1.0, 1.0, None), (int_dtype, (3,), "Sum", 1.0, 1.0, None),
             (float_dtype, (2, 2), "Sum", 1.0, 1.0, None), (float_dtype, (3,), "Max", 1.0, 1.0, None),
             (float_dtype, (3,), "Sum", 2.0, 0.25, None), (float_dtype, (3,), "Sum", 1.0, 1.0, part)]
    for name in ["reused", None]:
        for form, allreduce in fw.allreduce_forms().items():
            for dtype, shape, op, pre, post, process_set in cases + cases[:1]:
                ranks = range(n) if process_set is None or process_set.ranks is None else process_set.ranks
                inputs = {r: rank_values(shape, dtype, r) for r in ranks}
                out = allreduce(fw.tensor(inputs[me]), getattr(fw.api, op), name, pre, post, process_set)
                expected = reduced(op, [inputs[r] for r in ranks], dtype, len(ranks))
                if pre != 1.0 or post != 1.0:
                    expected = (reduced(op, [inputs[r] for r in ranks], "float64", len(ranks)) * pre * post
                                ).astype(np_dtype(dtype))
                assert_exact(fw, out, expected)


def test_allreduce_bool_means_any_or_all(fw):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values((9,), "bool", r) for r in range(n)]
    sync = next(iter(fw.allreduce_forms().values()))
    for op, fold in [("Sum", np.any), ("Max", np.any), ("Min", np.all), ("Product", np.all)]:
        out = sync(fw.tensor(inputs[me]), getattr(fw.api, op), tag("arb", op), 1.0, 1.0, None)
        assert_exact(fw, out, fold(inputs, axis=0))


def test_allreduce_prescale_and_postscale(fw, float_dtype):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values((11,), float_dtype, r) for r in range(n)]
    for form, allreduce in fw.allreduce_forms().items():
        out = allreduce(fw.tensor(inputs[me]), fw.api.Sum, tag("scaled", form, float_dtype), 2.0, 0.25, None)
        assert_exact(fw, out, (reduced("Sum", inputs, "float64", n) * 0.5).astype(np_dtype(float_dtype)))


def test_grouped_allreduce_of_mixed_dtypes_and_shapes(fw):
    n, me = unison.size(), unison.rank()
    dtypes = [d for d in ["float32", "int32", "float64", "uint8"] if d in fw.reduce_dtypes]
    shapes = [(3,), (), (0,), (2, 2), (7,)]
    cases = [(shapes[i % len(shapes)], dtypes[i % len(dtypes)]) for i in range(7)]
    inputs = [[rank_values(s, d, r) for r in range(n)] for s, d in cases]
    outs = fw.grouped_allreduce([fw.tensor(v[me]) for v in inputs], fw.api.Sum, "gar", None)
    assert len(outs) == len(cases)
    for out, v, (s, d) in zip(outs, inputs, cases):
        assert_exact(fw, out, reduced("Sum", v, d, n))


# ---- Adasum ------------------------------------------------------------------------

def adasum_pair(a, b):
    dot, aa, bb = a @ b, a @ a, b @ b
    return (1 - dot / (2 * aa) if aa > 0 else 1.0) * a + (1 - dot / (2 * bb) if bb > 0 else 1.0) * b


def adasum_reference(parts):
    """native/adasum.h's order in float64: ranks past the largest power of
    two p fold into rank r - p, then neighbours pair at distance 1, 2, 4..."""
    parts = [p.astype(np.float64).reshape(-1) for p in parts]
    p = 1
    while p * 2 <= len(parts):
        p *= 2
    for r in range(p, len(parts)):
        parts[r - p] = adasum_pair(parts[r - p], parts[r])
    level = parts[:p]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def test_adasum_matches_the_float64_reference(fw, float_dtype, shape):
    n, me = unison.size(), unison.rank()
    rng = np.random.default_rng(11)  # the same draws on every rank
    parts = [rng.standard_normal(shape).astype(np_dtype(float_dtype)) for _ in range(n)]
    sync = next(iter(fw.allreduce_forms().values()))
    out = fw.numpy(sync(fw.tensor(parts[me]), fw.api.Adasum, tag("adasum", float_dtype, shape), 1.0, 1.0, None))
    assert out.dtype == np_dtype(float_dtype) and out.shape == shape
    tolerance = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[float_dtype]
    expected = adasum_reference(parts).reshape(shape)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tolerance, atol=tolerance)


def test_adasum_of_equal_gradients_is_that_gradient_and_orthogonal_ones_add(fw):
    n, me = unison.size(), unison.rank()
    sync = next(iter(fw.allreduce_forms().values()))
    same = np.arange(6, dtype=np.float64) - 2.5
    assert_exact(fw, sync(fw.tensor(same), fw.api.Adasum, "adasum.same", 1.0, 1.0, None), same)
    axis = np.zeros(n)
    axis[me] = me + 1.0
    assert_exact(fw, sync(fw.tensor(axis), fw.api.Adasum, "adasum.orth", 1.0, 1.0, None), np.arange(1.0, n + 1))


def test_adasum_of_fused_tensors_is_per_tensor(fw):
    n, me = unison.size(), unison.rank()
    rng = np.random.default_rng(5)
    shapes = [(3,), (1000,), (0,), (4, 5)]
    parts = [[rng.standard_normal(s) for s in shapes] for _ in range(n)]
    outs = fw.grouped_allreduce([fw.tensor(p) for p in parts[me]], fw.api.Adasum, "adasum.fused", None)
    for i, (out, s) in enumerate(zip(outs, shapes)):
        expected = adasum_reference([p[i] for p in parts]).reshape(s)
        np.testing.assert_allclose(fw.numpy(out), expected, rtol=1e-12, atol=1e-12)


def test_adasum_refuses_integers_on_every_rank(fw):
    dtype = next(d for d in fw.reduce_dtypes if d.startswith("int"))
    sync = next(iter(fw.allreduce_forms().values()))
    with pytest.raises(Exception, match="Adasum needs a floating-point tensor"):
        sync(fw.tensor(rank_values((3,), dtype, 0)), fw.api.Adasum, "adasum.int", 1.0, 1.0, None)
    fw.barrier(None)


# ---- allgather ---------------------------------------------------------------------

def test_allgather_ranks_contribute_different_first_dims(fw, dtype, row_shape):
    n, me = unison.size(), unison.rank()

    def contribution(r):
        rows = row_shape[0] + r if row_shape[0] else 0  # empty everywhere stays empty
        return rank_values((rows,) + row_shape[1:], dtype, r)

    expected = np.concatenate([contribution(r) for r in range(n)])
    for form, allgather in fw.allgather_forms().items():
        assert_exact(fw, allgather(fw.tensor(contribution(me)), tag("ag", form, dtype, row_shape), None), expected)


def test_grouped_allgather(fw):
    n, me = unison.size(), unison.rank()
    dtypes = [d for d in ["int32", "float64", "uint8"] if d in fw.dtypes]
    mine = [rank_values((me + 1, 2), dtypes[0], me), rank_values((3,), dtypes[1], me),
            rank_values((0, 4), dtypes[2], me)]
    outs = fw.grouped_allgather([fw.tensor(x) for x in mine], "gag", None)
    assert_exact(fw, outs[0], np.concatenate([rank_values((r + 1, 2), dtypes[0], r) for r in range(n)]))
    assert_exact(fw, outs[1], np.concatenate([rank_values((3,), dtypes[1], r) for r in range(n)]))
    assert_exact(fw, outs[2], np.zeros((0, 4), np_dtype(dtypes[2])))


# ---- broadcast ---------------------------------------------------------------------

def test_broadcast_from_every_root(fw, dtype, shape):
    n, me = unison.size(), unison.rank()
    for form, broadcast_every_root in fw.broadcast_every_root_forms().items():
        outs = broadcast_every_root([fw.tensor(rank_values(shape, dtype, me)) for _ in range(n)],
                                    [tag("bc", form, dtype, shape, root) for root in range(n)], None)
        assert len(outs) == n, (form, len(outs))
        for root, out in enumerate(outs):
            assert_exact(fw, out, rank_values(shape, dtype, root))


# ---- alltoall ----------------------------------------------------------------------

def test_alltoall_with_uneven_splits(fw, dtype):
    n, me = unison.size(), unison.rank()

    # Rank s sends (2s + d) % 3 rows to rank d, each row tagged with s and d.
    # What s sends d is not what d sends s, so a rank that placed what it
    # received by what it sent would be caught.
    def count(s, d):
        return (2 * s + d) % 3

    def rows(s, d):
        return np.full((count(s, d), 2), (s * 10 + d) % 127)

    data = np.concatenate([rows(me, d) for d in range(n)]).astype(np_dtype(dtype))
    out, received = fw.alltoall(fw.tensor(data), [count(me, d) for d in range(n)], tag("a2a", dtype), None)
    assert_exact(fw, out, np.concatenate([rows(s, me) for s in range(n)]).astype(np_dtype(dtype)))
    assert list(received) == [count(s, me) for s in range(n)]


def test_alltoall_even_split_and_zero_rows(fw):
    n, me = unison.size(), unison.rank()
    x = np.arange(n * 2, dtype=np.int32).reshape(n, 2) + 100 * me
    out = fw.alltoall_even(fw.tensor(x), "a2a.even", None)
    assert_exact(fw, out, np.stack([np.array([2 * me, 2 * me + 1], np.int32) + 100 * s for s in range(n)]))
    out, received = fw.alltoall(fw.tensor(np.zeros((0, 3), np.float32)), [0] * n, "a2a.empty", None)
    assert_exact(fw, out, np.zeros((0, 3), np.float32))
    assert list(received) == [0] * n


# ---- reducescatter -----------------------------------------------------------------

@pytest.mark.parametrize("rows", [0, 1, 7, 12])
def test_reducescatter_uneven_rows(fw, reduce_dtype, rows):
    n, me = unison.size(), unison.rank()
    inputs = [rank_values((rows, 3), reduce_dtype, r) for r in range(n)]
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(counts[:me])
    for form, reducescatter in fw.reducescatter_forms().items():
        for op in ["Sum", "Max"]:
            out = reducescatter(fw.tensor(inputs[me]), getattr(fw.api, op), tag("rs", form, op, reduce_dtype, rows),
                                None)
            assert_exact(fw, out, reduced(op, inputs, reduce_dtype, n)[start:start + counts[me]])


def test_grouped_reducescatter(fw):
    n, me = unison.size(), unison.rank()
    inputs = [[rank_values((2 * n + 1, 2), "float32", r) for r in range(n)],
              [rank_values((n,), "int32", r) for r in range(n)]]
    outs = fw.grouped_reducescatter([fw.tensor(v[me]) for v in inputs], fw.api.Sum, "grs", None)
    first = (2 * n + 1) // n
    start = me * first + min(me, (2 * n + 1) % n)
    assert_exact(fw, outs[0], reduced("Sum", inputs[0], "float32", n)[start:start + first + (me < (2 * n + 1) % n)])
    assert_exact(fw, outs[1], reduced("Sum", inputs[1], "int32", n)[me:me + 1])


def _needs(fw, function, *keywords):
    """Skips, naming what is missing, where the front end does not offer
    these keywords (TensorFlow and MXNet keep Horovod's signatures)."""
    missing = [k for k in keywords if not fw._takes(function, k)]
    if missing:
        pytest.skip("%s's %s takes no %s" % (fw.name, function, ", ".join(missing)))


def test_reducescatter_with_splits(fw, reduce_dtype):
    _needs(fw, "reducescatter_async", "splits", "output")
    n, me = unison.size(), unison.rank()
    splits = [2 * r % 3 for r in range(n)]   # uneven, and rank 0 gets none: [0], [0, 2], [0, 2, 1]
    inputs = [rank_values((sum(splits), 2), reduce_dtype, r) for r in range(n)]
    start = sum(splits[:me])
    expected = reduced("Sum", inputs, reduce_dtype, n)[start:start + splits[me]]
    out = fw.reducescatter_split(fw.tensor(inputs[me]), fw.api.Sum, splits, tag("rs.splits", reduce_dtype), None)
    assert_exact(fw, out, expected)
    # Into the caller's output, with a row to spare that stays as it was.
    output = fw.tensor(np.full((splits[me] + 1, 2), 7, np_dtype(reduce_dtype)))
    out = fw.reducescatter_split(fw.tensor(inputs[me]), fw.api.Sum, splits, tag("rs.into", reduce_dtype), None,
                                 output)
    assert out is output
    assert_exact(fw, output, np.concatenate([expected, np.full((1, 2), 7, np_dtype(reduce_dtype))]))


def test_reducescatter_splits_that_differ_fail_on_every_rank(fw):
    _needs(fw, "reducescatter_async", "splits")
    n, me = unison.size(), unison.rank()
    if n == 1:
        with pytest.raises(Exception, match=r"splits \[2\] add up to 2 rows, the tensor has 3"):
            fw.reducescatter_split(fw.tensor(np.ones((3,), np.float32)), fw.api.Sum, [2], "rs.bad", None)
        return
    splits = [1] * n
    splits[0] += n - 1 if me == 0 else 0    # rank 0 asks for all the rest itself
    splits[-1] += n - 1 if me != 0 else 0   # the others give it to the last rank
    rank0 = "[%s]" % ", ".join(str(c) for c in [n] + [1] * (n - 1))
    others = "[%s]" % ", ".join(str(c) for c in [1] * (n - 1) + [n])
    message = ("reducescatter 'rs.differ': ranks disagree on splits (the rows each rank receives): rank 0 %s, %s"
               % (rank0, ", ".join("rank %d %s" % (r, others) for r in range(1, n))))
    with pytest.raises(Exception, match=re.escape(message)):
        fw.reducescatter_split(fw.tensor(np.ones((2 * n - 1,), np.float32)), fw.api.Sum, splits, "rs.differ", None)
    out = fw.reducescatter_split(fw.tensor(np.ones((n,), np.float32)), fw.api.Sum, [1] * n, "rs.after", None)
    assert_exact(fw, out, np.full((1,), float(n), np.float32))   # still usable


def test_allgather_into_the_callers_output_in_place(fw, dtype):
    _needs(fw, "allgather_async", "output")
    n, me = unison.size(), unison.rank()
    rows = [r % 3 + 1 for r in range(n)]
    start = sum(rows[:me])
    expected = np.concatenate([rank_values((rows[r], 2), dtype, r) for r in range(n)])
    output = fw.tensor(np.zeros_like(expected))
    mine = output[start:start + rows[me]]            # this rank's rows of the output: in place
    mine[...] = fw.tensor(rank_values((rows[me], 2), dtype, me))
    out = fw.allgather_into(mine, output, tag("ag.into", dtype), None)
    assert out is output
    assert_exact(fw, output, expected)


def test_allgather_into_an_output_too_small_fails_on_that_rank_only(fw):
    _needs(fw, "allgather_async", "output")
    n, me = unison.size(), unison.rank()
    output = fw.tensor(np.zeros((n - 1 if me == 0 else n, 3), np.float32))
    x = fw.tensor(np.full((1, 3), me, np.float32))
    if me == 0:
        with pytest.raises(Exception, match=r"allgather 'ag.small': the output holds %d bytes, the result needs %d"
                                            % (12 * (n - 1), 12 * n)):
            fw.allgather_into(x, output, "ag.small", None)
    else:
        fw.allgather_into(x, output, "ag.small", None)
        assert_exact(fw, output, np.repeat(np.arange(n, dtype=np.float32), 3).reshape(n, 3))
    out = fw.allgather_into(x, fw.tensor(np.zeros((n, 3), np.float32)), "ag.after", None)
    assert_exact(fw, out, np.repeat(np.arange(n, dtype=np.float32), 3).reshape(n, 3))


# ---- every collective on a process set -----------------------------------------------

def test_every_collective_on_a_process_set(fw, part):
    me, ranks = unison.rank(), part.ranks if part.ranks else list(range(unison.size()))
    k, mine = len(ranks), part.rank()
    sync_ar = next(iter(fw.allreduce_forms().values()))
    out = sync_ar(fw.tensor(np.full(3, me + 1.0)), fw.api.Sum, "ps.ar", 1.0, 1.0, part)
    assert_exact(fw, out, np.full(3, float(sum(r + 1 for r in ranks))))
    out = sync_ar(fw.tensor(np.full(4, me + 1.0)), fw.api.Adasum, "ps.adasum", 1.0, 1.0, part)
    np.testing.assert_allclose(fw.numpy(out), adasum_reference([np.full(4, r + 1.0) for r in ranks]), rtol=1e-12)
    gather = next(iter(fw.allgather_forms().values()))
    assert_exact(fw, gather(fw.tensor(np.full((me + 1,), me, np.int32)), "ps.ag", part),
                 np.array([r for r in ranks for _ in range(r + 1)], np.int32))
    broadcast = next(iter(fw.broadcast_forms().values()))
    assert_exact(fw, broadcast(fw.tensor(np.array([me, me], np.float32)), ranks[-1], "ps.bc", part),
                 np.full(2, float(ranks[-1]), np.float32))
    out, received = fw.alltoall(fw.tensor(np.arange(k, dtype=np.float64) + 10 * me), [1] * k, "ps.a2a", part)
    assert_exact(fw, out, np.array([10.0 * r + mine for r in ranks]))
    assert list(received) == [1] * k
    scatter = next(iter(fw.reducescatter_forms().values()))
    assert_exact(fw, scatter(fw.tensor(np.ones((2 * k, 2))), fw.api.Sum, "ps.rs", part), np.full((2, 2), float(k)))
    fw.barrier(part)


# ---- random programs ---------------------------------------------------------------
#
# The tests above start one op and wait for it. Training starts many and
# waits later, each rank in its own order and at its own pace: the core must
# then negotiate which ops every rank has, fuse what is ready, and hand each
# rank its own results. A program here is a few waves of asynchronous ops
# drawn at random from one seed, so every rank draws the same ones: every
# collective, every reduce op, every dtype, zero-size, scalar and large
# tensors, scale factors, ragged rows and splits, some on this rank's half
# of the job. Each rank then starts its wave's ops in an order of its own,
# sometimes pausing between them, and waits for them in another order of
# its own. Names come from a small pool, so a later wave reuses them with
# another dtype, shape, op or process set. Every rank computes every other
# rank's inputs from the seed and checks its results exactly.

PROGRAM_SEEDS = list(range(16))
PROGRAM_NAMES = ["prog.%d" % i for i in range(12)]
# Each kind of op, by its asynchronous form; a front end runs those it has.
PROGRAM_ASYNC = {"allreduce": "allreduce_async", "allreduce_": "allreduce_async_",
                 "grouped_allreduce": "grouped_allreduce_async", "grouped_allreduce_": "grouped_allreduce_async_",
                 "allgather": "allgather_async", "grouped_allgather": "grouped_allgather_async",
                 "broadcast": "broadcast_async", "broadcast_": "broadcast_async_", "alltoall": "alltoall_async",
                 "reducescatter": "reducescatter_async", "grouped_reducescatter": "grouped_reducescatter_async"}
REDUCING = ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "reducescatter",
            "grouped_reducescatter")
RAGGED = ("allgather", "grouped_allgather", "alltoall")   # each rank's first dimension is its own
IN_PLACE = ("allreduce_", "grouped_allreduce_", "broadcast_")
SCALES = [1.0, 0.5, 2.0]   # powers of two: scaling is exact, so the results are too


def program_values(seed, index, rank, shape, dtype, low=0, high=6):
    """Rank `rank`'s input to tensor `index` of program `seed`: small integers, exact in every dtype.
    Drawn as int8 and widened once: a program's large tensors (up to 300,000
    elements, drawn for every member by every rank) then cost a byte an
    element to draw, where int64 draws cost eight and a copy more."""
    rng = np.random.default_rng([seed, index, rank])
    if dtype == "bool":
        return np.asarray(rng.integers(0, 2, size=shape, dtype=np.int8)).astype(bool)
    if dtype in COMPLEX:
        real, imag = (rng.integers(low, high, size=shape, dtype=np.int8) for _ in range(2))
        return (real + 1j * imag).astype(dtype)
    return np.asarray(rng.integers(low, high, size=shape, dtype=np.int8)).astype(np_dtype(dtype), copy=False)


def random_op(rng, fw, seed, index, name, on_part):
    """Op `index` of program `seed`, drawn from `rng` (the same on every rank)."""
    kinds = [k for k, form in PROGRAM_ASYNC.items() if fw._has(form)]
    kind = kinds[rng.integers(len(kinds))]
    op = dict(kind=kind, seed=seed, index=index, name=name, on_part=on_part, pre=1.0, post=1.0,
              choice=int(rng.integers(1 << 30)), scatter_splits=False, spoil=None)
    count = int(rng.integers(1, 4)) if kind.startswith("grouped") else 1
    tails = [[(), (3,), (2, 2)][rng.integers(3)] for _ in range(count)]
    if kind in REDUCING:
        op["op"] = OPS[rng.integers(len(OPS))]
        dtypes = fw.reduce_dtypes + ([d for d in COMPLEX if d in fw.dtypes] if op["op"] in ("Sum", "Average") else [])
        op["dtypes"] = [dtypes[rng.integers(len(dtypes))] for _ in range(count)]
        if kind.endswith("reducescatter"):
            op["shapes"] = [(int(rng.integers(0, 8)),) + tail for tail in tails]
            op["scatter_splits"] = kind == "reducescatter" and fw._takes("reducescatter_async", "splits") \
                and rng.random() < 0.5
        else:
            shapes = [(), (0,), (1,), (5,), (3, 4), (2, 3, 2), (int(rng.integers(40_000, 300_000)),)]
            op["shapes"] = [shapes[rng.integers(len(shapes))] for _ in range(count)]
        if op["op"] in ("Sum", "Average") and all(d in FLOATS for d in op["dtypes"]):
            op["pre"], op["post"] = SCALES[rng.integers(3)], SCALES[rng.integers(3)]
    else:
        op["dtypes"] = [fw.dtypes[rng.integers(len(fw.dtypes))] for _ in range(count)]
        op["shapes"] = [(int(rng.integers(0, 5)),) + tail for tail in tails]
    return op


def random_program(seed, fw, with_part):
    """Waves of ops, each with whether a barrier follows it. Names are
    unique within a wave and a process set, as ops in flight must be; the
    same name may be in flight on the job and on this rank's half at once."""
    rng = np.random.default_rng(seed)
    waves, index = [], 0
    for _ in range(8):
        wave, taken = [], set()
        for _ in range(int(rng.integers(1, 11))):
            on_part = bool(with_part and rng.random() < 0.3)
            name = str(rng.choice([n for n in PROGRAM_NAMES if (n, on_part) not in taken]))
            taken.add((name, on_part))
            wave.append(random_op(rng, fw, seed, index, name, on_part))
            index += 1
        spoilable = [op for op in wave if op["kind"] in SPOILS]
        if spoilable and rng.random() < 0.3:
            op = spoilable[rng.integers(len(spoilable))]
            modes = [m for m in SPOILS[op["kind"]] if m != "op" or op["dtypes"][0] not in COMPLEX]
            op["spoil"] = (modes[rng.integers(len(modes))], int(rng.integers(1 << 30)))
            op["pre"] = op["post"] = 1.0   # so that the odd rank's op is refused by no rank alone
        waves.append((wave, rng.random() < 0.3))
    return waves


# How one rank can differ from the others in an op that then fails on every
# rank of its set with a MismatchError naming it, while the wave's other ops
# complete, and later waves reuse its name.
SPOILS = {"allreduce": ("dtype", "shape", "op"), "allreduce_": ("dtype", "shape", "op"),
          "reducescatter": ("dtype", "shape", "op"), "allgather": ("dtype", "shape"),
          "broadcast": ("dtype", "shape", "root"), "broadcast_": ("dtype", "shape", "root")}


def odd_rank(op, members):
    """The rank that differs in a spoiled op; None where it is not spoiled
    or its set has one rank, which cannot differ from itself."""
    if op["spoil"] is None or len(members) < 2:
        return None
    return members[op["spoil"][1] % len(members)]


def as_the_odd_rank(op, fw):
    """The op as the odd rank gives it."""
    mode, odd = op["spoil"][0], dict(op)
    if mode == "dtype":
        others = [d for d in (fw.reduce_dtypes if op["kind"] in REDUCING else fw.dtypes) if d != op["dtypes"][0]]
        odd["dtypes"] = [others[op["spoil"][1] % len(others)]]
    elif mode == "shape":
        shape = op["shapes"][0]
        odd["shapes"] = [shape + (2,) if op["kind"] == "allgather" else (shape[0] + 1,) + shape[1:] if shape
                         else (2,)]
        odd["scatter_splits"] = False
    elif mode == "op":
        odd["op"] = OPS[(OPS.index(op["op"]) + 1) % len(OPS)]
    else:
        odd["choice"] = op["choice"] + 1
    return odd


def _drawn(op, *key):
    return np.random.default_rng([op["seed"], op["index"]] + list(key))


def alltoall_splits(op, rank, members):
    """The rows `rank` sends to each member."""
    return [int(s) for s in _drawn(op, rank, 11).integers(0, 3, size=len(members))]


def scatter_counts(op, i, rows, members):
    """Each member's rows of tensor i's reducescatter: the splits every rank
    gives, or the even split (the first ranks one more)."""
    k = len(members)
    if op["scatter_splits"]:
        return [int(s) for s in _drawn(op, i, 13).integers(0, 3, size=k)]
    return [rows // k + (1 if j < rows % k else 0) for j in range(k)]


def program_inputs(op, rank, members):
    """Every tensor `rank` gives to `op`."""
    out = []
    for i, (dtype, shape) in enumerate(zip(op["dtypes"], op["shapes"])):
        if op["kind"] == "alltoall":
            shape = (sum(alltoall_splits(op, rank, members)),) + shape[1:]
        elif op["kind"] in RAGGED:
            shape = (int(_drawn(op, rank, i, 7).integers(0, 4)),) + shape[1:]
        elif op["scatter_splits"]:
            shape = (sum(scatter_counts(op, i, 0, members)),) + shape[1:]
        low, high = (1, 3) if op.get("op") == "Product" else (0, 6)
        out.append(program_values(op["seed"], op["index"] * 4 + i, rank, shape, dtype, low, high))
    return out


def program_expected(op, members, me, mine):
    """What `op` gives rank `me`, whose inputs were `mine`: an array per
    tensor, and for alltoall the received splits after them."""
    inputs = {r: mine if r == me else program_inputs(op, r, members) for r in members}
    kind, k, position = op["kind"], len(members), members.index(me)
    if kind in ("broadcast", "broadcast_"):
        return [inputs[members[op["choice"] % k]][0]]
    if kind in ("allgather", "grouped_allgather"):
        return [np.concatenate([inputs[r][i] for r in members]) for i in range(len(op["dtypes"]))]
    if kind == "alltoall":
        parts = []
        for r in members:
            splits = alltoall_splits(op, r, members)
            start = sum(splits[:position])
            parts.append(inputs[r][0][start:start + splits[position]])
        return [np.concatenate(parts), [alltoall_splits(op, r, members)[position] for r in members]]
    results = []
    for i, dtype in enumerate(op["dtypes"]):
        scaled = [(x.astype(np.float64) * op["pre"]).astype(x.dtype) if op["pre"] != 1.0 else x
                  for x in (inputs[r][i] for r in members)]
        out = reduced(op["op"], scaled, dtype, k)
        if op["post"] != 1.0:
            out = (out.astype(np.float64) * op["post"]).astype(out.dtype)
        if kind.endswith("reducescatter"):
            counts = scatter_counts(op, i, out.shape[0], members)
            out = out[sum(counts[:position]):sum(counts[:position + 1])]
        results.append(out)
    return results


def start_program_op(fw, op, tensors, process_set, members):
    """Starts `op` asynchronously on this rank's `tensors`; returns its handle."""
    api, ps = fw.api, fw.ps(process_set)
    start = getattr(api, PROGRAM_ASYNC[op["kind"]])
    kind, name = op["kind"], op["name"]
    given = tensors if kind.startswith("grouped") else tensors[0]
    if kind in REDUCING:
        options = dict(op=getattr(api, op["op"]), name=name, prescale_factor=op["pre"],
                       postscale_factor=op["post"], process_set=ps)
        if op["scatter_splits"]:
            options["splits"] = scatter_counts(op, 0, 0, members)
        return start(given, **options)
    if kind in ("broadcast", "broadcast_"):
        return start(given, members[op["choice"] % len(members)], name=name, process_set=ps)
    if kind == "alltoall":
        return start(given, splits=alltoall_splits(op, unison.rank(), members), name=name, process_set=ps)
    return start(given, name=name, process_set=ps)


def check_program_op(fw, op, tensors, result, expected):
    where = "op %d (%s %r)" % (op["index"], op["kind"], op["name"])
    if op["kind"] == "alltoall":
        output, received = result
        assert [int(s) for s in fw.numpy(received).tolist()] == expected[1], where
        result, expected = [output], expected[:1]
    elif not op["kind"].startswith("grouped"):
        result = [result]
    assert len(result) == len(expected), where
    if op["kind"] in IN_PLACE:
        assert all(got is given for got, given in zip(result, tensors)), where + ": the in-place form returned a copy"
    for got, want in zip(result, expected):
        try:
            assert_exact(fw, got, want)
        except AssertionError as e:
            raise AssertionError("%s: %s" % (where, e)) from None


def test_random_programs_of_asynchronous_collectives(fw, part, program_seed):
    missing = [form for form in ("allreduce_async", "synchronize") if not fw._has(form)]
    if missing:
        pytest.skip("%s has no asynchronous forms (%s): each op is waited for where it starts"
                    % (fw.name, ", ".join(missing)))
    n, me = unison.size(), unison.rank()
    everyone = list(range(n))
    part_members = part.ranks if part.ranks else everyone
    mine = np.random.default_rng([program_seed, me, 99])   # this rank's order and pace, no other's
    for wave, barrier_after in random_program(program_seed, fw, part.ranks is not None):
        started = []
        for position in mine.permutation(len(wave)):
            op = wave[position]
            process_set, members = (part, part_members) if op["on_part"] else (None, everyone)
            given = as_the_odd_rank(op, fw) if odd_rank(op, members) == me else op
            arrays = program_inputs(given, me, members)
            tensors = [fw.tensor(x) for x in arrays]   # copies: `arrays` stay as given, for the expected values
            if mine.random() < 0.2:
                time.sleep(mine.uniform(0, 0.003))
            started.append((op, arrays, tensors, members, start_program_op(fw, given, tensors, process_set, members)))
        for position in mine.permutation(len(started)):
            op, arrays, tensors, members, handle = started[position]
            if odd_rank(op, members) is None:   # then `given` was `op`
                check_program_op(fw, op, tensors, fw.api.synchronize(handle), program_expected(op, members, me, arrays))
                continue
            with pytest.raises(unison.MismatchError, match="'%s'" % re.escape(op["name"])):
                fw.api.synchronize(handle)
        if barrier_after:
            fw.barrier(None)
