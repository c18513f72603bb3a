"""A fuzz campaign of the public API, inside every rank: hypothesis draws
calls of every collective with names, dtypes, shapes, splits, roots, scale
factors, reduce ops, process sets and handles, well- and ill-formed, the
same on every rank (derandomized: a fixed seed, no example database), but
for the shapes, which differ by rank where the draw says so (and the op
negotiates them).

Every call must either return, with the exact answer where one is cheap to
say, or raise a clear error: a unison error, a TypeError or a ValueError
whose message starts with "unison:" or names what was wrong. Anything else
(a crash, an AttributeError from deep inside, a hang, which the per-test
timeout turns into a failure) fails the campaign, and after every call the
job must still work. test_parallel.py runs it at 1 and 2 ranks; the
sanitized envs run it too (tests/sanitized_suites.py)."""
import numpy as np
import pytest

from hypothesis import HealthCheck, given, settings, strategies as st

import unison
import unison.numpy as unp
from shared_grid import assert_same

EXAMPLES = 200
CAMPAIGN = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)

# Each argument is well formed most of the time, so that most calls reach
# the core (and its negotiation) with one or two bad arguments among good
# ones, not none at all.
def mostly(good, bad):
    # Both are drawn and one kept: hypothesis's choice among one_of's
    # branches is not uniform.
    return st.tuples(st.sampled_from([False] * 6 + [True]), good, bad).map(lambda t: t[2] if t[0] else t[1])


DTYPES = mostly(st.sampled_from(["uint8", "int8", "uint16", "int16", "int32", "uint32", "int64", "uint64", "float16",
                                 "float32", "float64", "bool", "complex64", "complex128"]),
                # Not collective types: each must be refused by name.
                st.sampled_from(["object", "U3", "datetime64[s]", "V4"]))
NAMES = mostly(st.one_of(st.none(), st.text(min_size=1, max_size=40)),
               st.one_of(st.just(""), st.just("bad\0name"), st.just("x" * 5000), st.integers(), st.binary(max_size=8),
                         st.floats(allow_nan=True), st.just(["a"])))
FACTORS = mostly(st.one_of(st.just(1.0), st.floats(-4, 4)),
                 st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.just("2"),
                           st.none(), st.just([2.0]), st.just(np.float32(0.5))))
ROOTS = mostly(st.integers(0, 1),
               st.one_of(st.integers(-2, 4), st.sampled_from([2 ** 31, -2 ** 31 - 1, 2 ** 63, -2 ** 64]),
                         st.just(1.5), st.just("0"), st.none(), st.just([0]), st.just(np.int64(0))))
REDUCE_OPS = mostly(st.sampled_from(["Sum", "Average", "Min", "Max", "Product", "Adasum"]),
                    st.one_of(st.just(99), st.just("sum"), st.none()))
SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)
SPLITS = mostly(st.none(),
                st.one_of(st.lists(st.one_of(st.integers(-2, 4), st.sampled_from([2 ** 62, 2 ** 63 - 1, -2 ** 63])),
                                   max_size=4),
                          st.just("12"), st.just([1.5]), st.just(np.array([2, 2])), st.just(3)))
HANDLES = st.one_of(st.integers(-2, 2 ** 40), st.none(), st.text(max_size=4), st.just(2 ** 70))
PROCESS_SETS = mostly(st.sampled_from(["global", "none"]), st.sampled_from(["bogus", "id"]))
CALLS = ["allreduce", "allreduce_", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
         "reducescatter", "grouped_reducescatter", "synchronize", "poll"]  # _call's keys

# Errors a caller can act on. Anything else, or one of these that says
# nothing of what was wrong, is an unclear error.
CLEAR = (unison.UnisonError, TypeError, ValueError, MemoryError)


def _tensor(dtype, shape, rank, differ):
    if differ and shape:
        shape = (shape[0] + rank,) + tuple(shape[1:])
    if dtype in ("object", "U3", "datetime64[s]", "V4"):
        return np.zeros(shape, dtype=dtype)
    return (np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64) % 3).astype(dtype).reshape(shape)


def _reduce_op(op):
    return getattr(unison, op) if op in ("Sum", "Average", "Min", "Max", "Product", "Adasum") else op


def _call(call, tensor, name, op, pre, post, root, splits, handle, process_set):
    common = {"name": name, "process_set": process_set}
    reducing = dict(common, op=op, prescale_factor=pre, postscale_factor=post)
    pair = [tensor, tensor.copy()]
    calls = {
        "allreduce": lambda: unp.allreduce(tensor, **reducing),
        "allreduce_": lambda: unp.allreduce_(tensor, **reducing),
        "grouped_allreduce": lambda: unp.grouped_allreduce(pair, **reducing),
        "allgather": lambda: unp.allgather(tensor, **common),
        "grouped_allgather": lambda: unp.grouped_allgather(pair, **common),
        "broadcast": lambda: unp.broadcast(tensor, root, **common),
        "alltoall": lambda: unp.alltoall(tensor, splits=splits, **common),
        "reducescatter": lambda: unp.reducescatter(tensor, **reducing),
        "grouped_reducescatter": lambda: unp.grouped_reducescatter(pair, **reducing),
        "synchronize": lambda: unp.synchronize(handle),
        "poll": lambda: unp.poll(handle),
    }
    return calls[call]()


unclear = []
outcomes = {}  # "returned", or the error's class: what the note counts


@CAMPAIGN
@given(call=st.sampled_from(CALLS), dtype=DTYPES, shape=SHAPES, differ=st.booleans(), name=NAMES, op=REDUCE_OPS,
       pre=FACTORS, post=FACTORS, root=ROOTS, splits=SPLITS, handle=HANDLES, process_set=PROCESS_SETS)
def test_every_drawn_call_returns_or_raises_a_clear_error_and_the_job_goes_on(call, dtype, shape, differ, name, op,
                                                                              pre, post, root, splits, handle,
                                                                              process_set):
    rank, size = unison.rank(), unison.size()
    # alltoall checks its first dimension against its splits on each rank
    # before anything is sent: ranks that differ there part ways (as a
    # script whose ranks differ would), and only the stall inspector, a
    # minute later, would end it. Everywhere else, shapes that differ by
    # rank meet in negotiation, which names them on every rank.
    tensor = _tensor(dtype, shape, rank, differ and call != "alltoall")
    chosen = {"global": unison.global_process_set, "none": None, "bogus": object(), "id": 0}[process_set]
    try:
        result = _call(call, tensor, name, _reduce_op(op), pre, post, root, splits, handle, chosen)
        outcomes["returned"] = outcomes.get("returned", 0) + 1
    except CLEAR as e:
        outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
        message = str(e)
        if not message or "unison" not in message and not isinstance(e, MemoryError):
            unclear.append((call, type(e).__name__, message))
    except Exception as e:  # noqa: BLE001: what the campaign looks for
        outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
        unclear.append((call, type(e).__name__, str(e)))
    else:
        # The cheap exact answer: a well-formed Sum of the same tensor on
        # every rank is size times it.
        if (call == "allreduce" and op == "Sum" and pre == 1.0 and post == 1.0 and not differ
                and dtype in ("int32", "int64", "float32", "float64")):
            assert_same(result, tensor * size)
    # The job goes on after every call, whatever it raised.
    total = unp.allreduce(np.array([rank + 1.0]), op=unison.Sum, name="fuzz.usable")
    assert total[0] == size * (size + 1) / 2


def test_the_campaign_found_no_unclear_error():
    """Runs after the campaign (pytest keeps a file's order)."""
    print("fuzz campaign at %d rank(s): %s" % (unison.size(), sorted(outcomes.items())))
    assert not unclear, "\n".join("%s: %s: %s" % u for u in unclear[:30])
