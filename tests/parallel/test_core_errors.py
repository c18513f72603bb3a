"""Bad input: a clear exception on every rank that names the tensor and
each rank's value, and the job stays usable afterwards."""
import pickle
import threading

import numpy as np
import pytest

import unison
import unison.numpy as unp
from shared_grid import assert_same
from unison import collective
from unison._native import ffi, lib


@pytest.fixture(autouse=True)
def still_usable_afterwards():
    yield
    n = unison.size()
    assert unp.allreduce(np.ones(2), op=unison.Sum, name="usable")[0] == n


def test_allreduce_mismatched_shapes_names_every_rank():
    me = unison.rank()
    with pytest.raises(unison.MismatchError) as error:
        unp.allreduce(np.ones(2 + me), name="bad.shape")
    message = str(error.value)
    assert "'bad.shape'" in message and "shape" in message
    for r in range(unison.size()):
        assert "rank %d [%d]" % (r, 2 + r) in message


def test_blocking_in_place_allreduce_mismatch_raises_and_the_name_stays_usable():
    me, n = unison.rank(), unison.size()
    with pytest.raises(unison.MismatchError) as error:
        unp.allreduce_(np.ones(2 + me), name="bad.in_place")
    message = str(error.value)
    assert "'bad.in_place'" in message
    for r in range(n):
        assert "rank %d [%d]" % (r, 2 + r) in message
    x = np.full(4, me + 1.0)
    assert unp.allreduce_(x, op=unison.Sum, name="bad.in_place") is x
    assert (x == n * (n + 1) / 2).all()


def test_allreduce_mismatched_dtypes():
    dtype = np.float32 if unison.rank() == 0 else np.int32
    with pytest.raises(unison.MismatchError, match=r"dtype: rank 0 float32, rank 1 int32"):
        unp.allreduce(np.ones(3, dtype=dtype), name="bad.dtype")


def test_allreduce_mismatched_reduce_ops():
    op = unison.Sum if unison.rank() == 0 else unison.Max
    with pytest.raises(unison.MismatchError, match=r"reduce op: rank 0 Sum, rank 1 Max"):
        unp.allreduce(np.ones(3), op=op, name="bad.op")


def test_mismatched_scale_factors():
    with pytest.raises(unison.MismatchError, match=r"prescale_factor: rank 0 1, rank 1 2"):
        unp.allreduce(np.ones(3), prescale_factor=1.0 + unison.rank(), name="bad.scale")


def test_broadcast_mismatched_roots():
    with pytest.raises(unison.MismatchError, match=r"root rank: rank 0 0, rank 1 1"):
        unp.broadcast(np.ones(3), unison.rank() % 2, name="bad.root")


def test_different_operations_under_one_name():
    with pytest.raises(unison.MismatchError, match=r"operation: rank 0 allreduce, rank 1 allgather"):
        if unison.rank() == 0:
            unp.allreduce(np.ones(3), name="bad.kind")
        else:
            unp.allgather(np.ones(3), name="bad.kind")


def test_allgather_mismatched_trailing_dims():
    with pytest.raises(unison.MismatchError, match="all but the first dimension"):
        unp.allgather(np.ones((2, 2 + unison.rank())), name="bad.gather")


def test_cached_tensor_changing_shape_is_renegotiated():
    n = unison.size()
    for _ in range(2):  # the second time goes through the response cache
        assert unp.allreduce(np.ones(4), op=unison.Sum, name="reshaped")[0] == n
    result = unp.allreduce(np.ones(6), op=unison.Sum, name="reshaped")
    assert_same(result, np.full(6, n))
    with pytest.raises(unison.MismatchError, match="shape"):
        unp.allreduce(np.ones(6 + unison.rank()), op=unison.Sum, name="reshaped")


def test_name_in_flight_twice_fails_at_enqueue():
    # Each rank's own name cannot complete before the others submit it, and
    # they do so only after the barrier, so it is surely still in flight.
    me, n = unison.rank(), unison.size()
    own = unp.allreduce_async(np.ones(2), op=unison.Sum, name="twice.%d" % me)
    with pytest.raises(unison.InvalidArgumentError, match="'twice.%d'.*already in flight on rank %d" % (me, me)):
        unp.allreduce_async(np.ones(2), op=unison.Sum, name="twice.%d" % me)
    unp.barrier()
    others = [unp.allreduce_async(np.ones(2), op=unison.Sum, name="twice.%d" % r) for r in range(n) if r != me]
    for h in [own] + others:
        assert unp.synchronize(h)[0] == n


def test_unsupported_dtype():
    with pytest.raises(unison.InvalidArgumentError, match="'long' has dtype float128, which unison does not"):
        unp.allreduce(np.ones(2, dtype=np.longdouble), name="long")


def test_negative_size():
    with pytest.raises(unison.InvalidArgumentError, match=r"negative size in shape \[2, -1\]"):
        collective.enqueue(lib.UNISON_ALLREDUCE, "neg", lib.UNISON_FLOAT32, (2, -1))


def test_null_pointers():
    with pytest.raises(unison.InvalidArgumentError, match="input pointer is NULL"):
        collective.enqueue(lib.UNISON_ALLREDUCE, "null", lib.UNISON_FLOAT32, (4,))


def test_gpu_placement_of_host_memory_names_the_tensor_and_the_process_goes_on():
    # Without CUDA (CI) the op is refused because GPU tensors cannot be
    # taken here at all; with it, because the memory is not device memory.
    values = np.ones(4, np.float32)
    pointer = ffi.cast("void*", values.ctypes.data)
    with pytest.raises(unison.UnisonError, match=r"allreduce 'gpu\.host': (the tensor is on GPU 0, but this process "
                                                 r"cannot use CUDA: |the input is not device memory)"):
        collective.enqueue(lib.UNISON_ALLREDUCE, "gpu.host", lib.UNISON_FLOAT32, (4,), pointer, pointer,
                           reduce_op=lib.UNISON_SUM, placement=(0, ffi.NULL))
    assert_same(unp.allreduce(values, op=unison.Sum, name="gpu.after"),
                np.full(4, float(unison.size()), np.float32))


def test_invalid_root_rank():
    with pytest.raises(unison.InvalidArgumentError, match="root rank 7 is outside"):
        unp.broadcast(np.ones(2), 7, name="root7")


def test_bad_splits():
    with pytest.raises(unison.InvalidArgumentError, match="add up to"):
        unp.alltoall(np.ones(unison.size() + 2), splits=[1] * unison.size(), name="splits")  # 2 rows over
    with pytest.raises(unison.InvalidArgumentError, match="negative split"):
        unp.alltoall(np.ones(1), splits=[2, -1] + [0] * (unison.size() - 2), name="splits")


def test_splits_whose_sum_wraps_around_int64_are_refused_and_the_job_goes_on():
    """[2^63 - 1, 2^63 - 1, 6] adds up to 4 once it wraps: a check that
    wrapped let it through for a 4-row tensor, and the collective then
    crashed the rank (reducescatter with SIGSEGV, alltoall in malloc).
    This file runs at 2, 3 and 5 ranks."""
    n, me, top, rows = unison.size(), unison.rank(), 2 ** 63 - 1, 4
    splits = ([top, top, rows + 2] + [0] * (n - 3)) if n >= 3 else [top, rows + 2]
    message = r"splits \[.*\] add up to more than 2\^63 - 1 rows, the tensor has 4"
    with pytest.raises(unison.InvalidArgumentError, match=r"alltoall 'wrap\.a2a': " + message):
        unp.alltoall(np.ones(rows), splits=splits, name="wrap.a2a")
    with pytest.raises(unison.InvalidArgumentError, match=r"reducescatter 'wrap\.rs': " + message):
        unp.reducescatter(np.ones(rows), op=unison.Sum, splits=splits, name="wrap.rs")
    # Still usable: every rank sends rows [start_d, start_d + even[d]) to rank d.
    even = [rows // n + (1 if d < rows % n else 0) for d in range(n)]
    start = sum(even[:me])
    out, received = unp.alltoall(np.arange(rows, dtype=np.float64), splits=even, name="wrap.after")
    assert_same(out, np.tile(np.arange(start, start + even[me], dtype=np.float64), n))
    assert received.tolist() == [even[me]] * n


@pytest.mark.parametrize("call,error,message", [
    (lambda: unp.allreduce(np.ones(2), name=123), TypeError, r"name must be a string, got 123 \(int\)"),
    (lambda: unp.allreduce(np.ones(2), name=b"bytes"), TypeError, r"name must be a string, got b'bytes'"),
    (lambda: unp.allreduce(np.ones(2), name="cut\0here"), unison.InvalidArgumentError,
     r"name 'cut\\x00here' contains a NUL character"),
    (lambda: unp.synchronize(42), TypeError, r"synchronize takes the handle an \*_async op returned, got 42"),
    (lambda: unp.poll("h"), TypeError, r"poll takes the handle an \*_async op returned, got 'h'"),
    (lambda: unp.broadcast(np.ones(2), 2 ** 31, name="root.big"), unison.InvalidArgumentError,
     r"root\.big: root_rank 2147483648 is not a rank"),
    (lambda: unp.broadcast(np.ones(2), 0.5, name="root.float"), TypeError,
     r"root\.float: root_rank must be an integer, got 0\.5"),
    (lambda: unp.allreduce(np.ones(2), name="pre.nan", prescale_factor=float("nan")), unison.InvalidArgumentError,
     r"pre\.nan: prescale_factor=nan is not a finite number"),
    (lambda: unp.allreduce(np.ones(2), name="post.inf", postscale_factor=float("inf")), unison.InvalidArgumentError,
     r"post\.inf: postscale_factor=inf is not a finite number"),
], ids=["name-int", "name-bytes", "name-nul", "synchronize-int", "poll-str", "root-past-int32", "root-float",
        "prescale-nan", "postscale-inf"])
def test_a_bad_argument_is_refused_on_its_rank_naming_it_and_the_job_goes_on(call, error, message):
    """Each is refused at the call, on the rank that made it, before
    anything is sent (every rank makes it here)."""
    with pytest.raises(error, match=message):
        call()
    assert_same(unp.allreduce(np.ones(2), op=unison.Sum, name="bad.arg.after"),
                np.full(2, unison.size()))


def test_average_of_bool_is_refused():
    with pytest.raises(unison.InvalidArgumentError, match="bool"):
        unp.allreduce(np.ones(2, dtype=bool), op=unison.Average, name="boolavg")


def test_adasum_refusals_name_the_tensor_and_the_job_goes_on():
    with pytest.raises(unison.InvalidArgumentError, match="'adasum.int'.*Adasum needs a floating-point tensor"):
        unp.allreduce(np.ones(2, dtype=np.int32), op=unison.Adasum, name="adasum.int")
    with pytest.raises(unison.InvalidArgumentError, match="adasum.scaled.*Adasum takes no prescale"):
        unp.allreduce(np.ones(2), op=unison.Adasum, prescale_factor=2.0, name="adasum.scaled")
    with pytest.raises(unison.InvalidArgumentError, match="adasum.rs.*op Adasum is not one of"):
        unp.reducescatter(np.ones((2, 2)), op=unison.Adasum, name="adasum.rs")
    assert_same(unp.allreduce(np.ones(2), op=unison.Adasum, name="adasum.after"), np.ones(2))


def test_bad_handle():
    with pytest.raises(unison.InvalidArgumentError, match="unknown handle"):
        unp.poll(unp.Handle(10 ** 9, "fake", (), None))
    lib.unison_release(10 ** 9)



def test_an_in_place_op_is_released_by_the_wait_that_ends_it_and_a_failed_one_keeps_its_message():
    """synchronize() waits for an op whose result the caller holds with
    unison_wait_release: one call ends it and frees its handle. A failed
    op's handle must stay for its message, then go."""
    me = unison.rank()
    x = np.full(3, me + 1, np.int64)
    done = unp.allreduce_async_(x, op=unison.Sum, name="released.ok")
    assert unp.synchronize(done) is x
    assert_same(x, np.full(3, sum(range(1, unison.size() + 1))))
    assert lib.unison_release(done.id) == lib.UNISON_ERR_INVALID_ARGUMENT   # released already
    assert "unknown handle %d" % done.id in ffi.string(lib.unison_last_error()).decode()

    failed = unp.allreduce_async_(np.ones(2 + me), name="released.bad.shape")
    with pytest.raises(unison.MismatchError, match=r"'released.bad.shape'.*rank 0 \[2\], rank 1 \[3\]"):
        unp.synchronize(failed)
    assert lib.unison_release(failed.id) == lib.UNISON_ERR_INVALID_ARGUMENT   # released after the message
    assert lib.unison_wait_release(failed.id, 0.0) == lib.UNISON_ERR_INVALID_ARGUMENT


def test_on_done_calls_back_once_with_the_status_from_the_completing_thread_or_at_once():
    """unison_on_done, by which a framework's asynchronous kernel completes
    (tf_adapter/kernels.cc): one call per op, with its status, whether the op
    ends after the callback is given (on the thread that completes it), ends
    in failure, or had ended before (at once, on the caller's thread). The
    callback may read and release the handle."""
    me, n = unison.rank(), unison.size()
    calls = []
    ended = threading.Event()

    @ffi.callback("void(void*, int64_t, int)")
    def done(arg, handle, status):
        message = ffi.new("char[]", 512)
        if status:
            lib.unison_handle_error(handle, message, 512)
        calls.append((ffi.cast("intptr_t", arg), handle, status, ffi.string(message).decode(),
                      threading.get_ident()))
        lib.unison_release(handle)
        ended.set()

    def started(x, name, tag):
        handle = unp.allreduce_async_(x, op=unison.Sum, name=name)
        assert lib.unison_on_done(handle.id, done, ffi.cast("void*", tag)) == lib.UNISON_OK
        return handle.id

    x = np.full(5, me + 1.0)
    first = started(x, "on_done.ok", 7)
    assert ended.wait(60), "the callback never came"
    assert calls == [(7, first, lib.UNISON_OK, "", calls[0][4])]
    assert_same(x, np.full(5, n * (n + 1) / 2))
    assert lib.unison_release(first) == lib.UNISON_ERR_INVALID_ARGUMENT   # the callback released it

    calls.clear()
    ended.clear()
    failed = started(np.ones(2 + me), "on_done.bad.shape", 8)
    assert ended.wait(60), "the callback never came"
    assert [c[:3] for c in calls] == [(8, failed, lib.UNISON_ERR_MISMATCH)]
    assert "'on_done.bad.shape'" in calls[0][3] and "rank 0 [2], rank 1 [3]" in calls[0][3], calls

    calls.clear()
    ended.clear()
    y = np.full(3, me + 1.0)
    finished = unp.allreduce_async_(y, op=unison.Sum, name="on_done.after")
    assert lib.unison_wait(finished.id, -1.0) == lib.UNISON_OK
    assert lib.unison_on_done(finished.id, done, ffi.cast("void*", 9)) == lib.UNISON_OK
    assert calls == [(9, finished.id, lib.UNISON_OK, "", threading.get_ident())]   # at once, here
    assert_same(y, np.full(3, n * (n + 1) / 2))
    assert lib.unison_on_done(10 ** 9, done, ffi.NULL) == lib.UNISON_ERR_INVALID_ARGUMENT


# ---- objects that cannot be serialised -----------------------------------------------

class Unpicklable:
    def __reduce__(self):
        raise TypeError("not picklable, on purpose")


def test_a_root_whose_object_does_not_serialise_fails_every_rank_at_once_naming_it():
    """The root used to raise alone, and the others waited in the broadcast
    until the deadlock watch gave up on them, with no word of why."""
    from unison import objects
    me, root = unison.rank(), unison.size() - 1
    if me == root:
        with pytest.raises(TypeError, match="not picklable, on purpose"):
            objects.broadcast_object(Unpicklable(), root_rank=root, name="obj.bad")
    else:
        with pytest.raises(unison.InvalidArgumentError) as error:
            objects.broadcast_object(None, root_rank=root, name="obj.bad")
        assert str(error.value) == (
            "unison: broadcast_object 'obj.bad': the object of rank %d could not be serialised, so no rank "
            "received any (rank %d: TypeError: not picklable, on purpose)" % (root, root))
    assert objects.broadcast_object({"root": me}, root_rank=root, name="obj.bad") == {"root": root}


def test_allgather_object_names_every_rank_whose_object_does_not_serialise():
    from unison import objects
    me, n = unison.rank(), unison.size()
    bad = [r for r in range(n) if r % 2 == 1]
    if me in bad:
        with pytest.raises(TypeError, match="not picklable, on purpose"):
            objects.allgather_object(Unpicklable(), name="obj.gather.bad")
    else:
        with pytest.raises(unison.InvalidArgumentError) as error:
            objects.allgather_object(me, name="obj.gather.bad")
        reasons = "; ".join("rank %d: TypeError: not picklable, on purpose" % r for r in bad)
        assert str(error.value) == (
            "unison: allgather_object 'obj.gather.bad': the object of rank%s %s could not be serialised, so no "
            "rank received any (%s)" % ("s" if len(bad) > 1 else "", ", ".join(map(str, bad)), reasons))
    assert objects.allgather_object({"rank": me}, name="obj.gather.bad") == [{"rank": r} for r in range(n)]


def test_what_has_no_importable_name_goes_by_value_where_cloudpickle_is_installed():
    """As Horovod, which sends every object through cloudpickle: a lambda
    or a closure arrives working; where cloudpickle is missing, every rank
    is told which rank's object could not be sent."""
    from unison import objects
    from unison.runner.function import cloudpickle_or_none
    me, n, root = unison.rank(), unison.size(), unison.size() - 1
    offset = 10 * me
    mine = {"scale": lambda x: x * (me + 1), "shift": (lambda: lambda x: x + offset)()}
    if cloudpickle_or_none() is not None:
        got = objects.broadcast_object(mine, root_rank=root, name="obj.lambda")
        assert (got["scale"](2), got["shift"](1)) == (2 * (root + 1), 1 + 10 * root)
        gathered = objects.allgather_object(mine, name="obj.lambdas")
        assert [(g["scale"](2), g["shift"](1)) for g in gathered] == [(2 * (r + 1), 1 + 10 * r) for r in range(n)]
    else:
        # pickle refuses a function defined inside another with AttributeError
        # ("Can't pickle local object"), a top-level lambda with PicklingError.
        expected = unison.InvalidArgumentError if me != root else (pickle.PicklingError, AttributeError)
        with pytest.raises(expected, match="lambda"):
            objects.broadcast_object(mine, root_rank=root, name="obj.lambda")


def test_a_result_larger_than_memory_is_out_of_memory_on_every_rank_never_an_abort():
    """An allgather whose result cannot be allocated (the address space is
    capped just above what the rank holds) is an OutOfMemoryError, also a
    MemoryError, on every rank (every rank needs the same result); never an
    abort. A rank that could not take its part has left its peers out of
    step, so the session ends with that reason, and a new one (shutdown,
    init) goes on."""
    import os
    import resource
    if "san.so" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("a sanitizer's allocator maps terabytes of shadow up front, so a cap on the address space cannot "
                    "single out one allocation; the core's own envs run this")
    n = unison.size()
    rows = np.full((40 << 20) // 8, unison.rank(), np.float64)  # 40 MiB each; the result is n times that
    unp.allreduce(np.ones(1), name="oom.warm")  # every buffer the small ops need exists before the cap
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (24 << 20), hard))
    try:
        with pytest.raises(unison.OutOfMemoryError) as error:
            unp.allgather(rows, name="oom.allgather")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert isinstance(error.value, MemoryError)
    expected = "unison: cannot allocate %d bytes for the result" % (n * (40 << 20))
    assert str(error.value) == expected, error.value
    with pytest.raises(unison.OutOfMemoryError, match=expected):
        unp.allreduce(np.ones(1), name="oom.next")
    unison.shutdown()
    unison.init()
    assert_same(unp.allgather(rows[:4], name="oom.after"), np.repeat(np.arange(n), 4).astype(float))
