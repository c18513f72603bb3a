"""unison.torch's compiled per-tensor path (torch_adapter/fast_path.cc):
which in-place allreduces it starts, that they give what the Python path
gives, exactly, and that whatever it does not take goes the Python way and
fails there as it always did. The shared grid's repeated-step test runs
every dtype through it; tests/test_torch.py builds, caches and refuses it.

CI builds it (the build must work there), so a run without it fails here
rather than passing on the Python path alone; UNISON_TORCH_FAST_PATH=0 is
the one way to run these on the Python path."""
import os
import signal
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import unison  # noqa: E402
import unison.torch as hvd  # noqa: E402
from unison import adapter_extension, handles  # noqa: E402
from unison.torch import ops  # noqa: E402

torch.set_num_threads(1)
CHOSEN_OFF = os.environ.get("UNISON_TORCH_FAST_PATH", "auto").strip().lower() in ("0", "false", "no", "off")


@pytest.fixture
def fast():
    if CHOSEN_OFF:
        assert ops._fast is None and adapter_extension.ACTIVE["PyTorch"].startswith("the Python path (")
        pytest.skip("UNISON_TORCH_FAST_PATH=0 chose the Python path")
    assert ops._fast is not None, adapter_extension.ACTIVE.get("PyTorch")
    assert adapter_extension.ACTIVE["PyTorch"].startswith("compiled ("), adapter_extension.ACTIVE
    return ops._fast


def values(shape, dtype, rank, step=0):
    return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 5 + rank + step + 1).to(dtype)


def summed(shape, dtype, step=0):
    return sum(values(shape, dtype, r, step).double() for r in range(hvd.size())).to(dtype)


def started_through(fast, call):
    """What `call` returns, and how many ops the compiled path started in it."""
    before = fast.started()
    result = call()
    return result, fast.started() - before


def test_repeats_of_an_in_place_allreduce_start_in_cpp_and_reduce_each_steps_values(fast):
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8]:
        for step in range(3):
            x = values((4, 3), dtype, hvd.rank(), step)
            handle, count = started_through(fast, lambda: hvd.allreduce_async_(x, name="fp.%s" % dtype, op=hvd.Sum))
            assert hvd.synchronize(handle) is x
            torch.testing.assert_close(x, summed((4, 3), dtype, step), rtol=0, atol=0)
            # The first call goes the Python way, which checks the op and teaches it to the compiled path.
            assert count == (0 if step == 0 else 1), (dtype, step, count)


def test_every_in_place_form_and_the_optimizers_hook_take_it(fast):
    x = values((5,), torch.float32, hvd.rank())
    for step in range(2):
        y = x.clone()
        _, count = started_through(fast, lambda: hvd.allreduce_(y, name="fp.blocking", op=hvd.Sum))
        torch.testing.assert_close(y, summed((5,), torch.float32), rtol=0, atol=0)
        assert count == step
        ys = [x.clone(), x.clone() * 2]
        _, count = started_through(fast, lambda: hvd.grouped_allreduce_(ys, name="fp.grouped", op=hvd.Sum))
        torch.testing.assert_close(ys[1], 2 * summed((5,), torch.float32), rtol=0, atol=0)
        assert count == 2 * step
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    counts = []
    for step in range(3):
        optimizer.zero_grad()
        before = fast.started()
        model(torch.full((2, 3), float(hvd.rank() + step))).sum().backward()
        optimizer.step()
        counts.append(fast.started() - before)
    assert counts == [0, 2, 2], counts   # the weight's and the bias's, from the second step on


def exact(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def in_flight(group):
    return [h.id for h in group.handles if h.id in handles._in_flight]


@pytest.fixture
def group_waits(monkeypatch):
    """How many members each HandleGroup's synchronize had the compiled
    waiter (synchronize_many) finish."""
    counts, waiter = [], handles._group_waiter
    assert waiter is not None

    def counted(members):
        counts.append(waiter(members))
        return counts[-1]
    monkeypatch.setattr(handles, "_group_waiter", counted)
    return counts


def test_a_grouped_in_place_allreduce_starts_and_waits_for_its_members_in_one_call_each(fast, group_waits):
    # From the second call on, allreduce_many_ starts all three members;
    # synchronize_many finishes every member each time (those the Python
    # path started on the first call are in-place handles too).
    shapes = [(3,), (2, 2), (5,)]
    for step in range(3):
        xs = [values(s, torch.float32, hvd.rank(), step + i) for i, s in enumerate(shapes)]
        group, count = started_through(fast, lambda: hvd.grouped_allreduce_async_(xs, name="fp.many", op=hvd.Sum))
        results = hvd.synchronize(group)
        assert count == (0 if step == 0 else 3) and group_waits[-1] == 3, (step, count, group_waits)
        assert all(r is x for r, x in zip(results, xs))
        for i, (x, s) in enumerate(zip(xs, shapes)):
            exact(x, summed(s, torch.float32, step + i))
        assert in_flight(group) == []
        assert hvd.synchronize(group) == results   # a second synchronize gives the same tensors


def test_a_member_the_compiled_path_declines_and_the_ones_after_it_go_the_python_way(fast, group_waits):
    # The strided member stops allreduce_many_: the Python path starts it
    # (on a contiguous copy, copied back at the wait) and the one after it
    # (through the compiled path's single start). The waiter finishes the
    # first member and leaves the copy-back to synchronize.
    def members(rank, step):
        return [values((4,), torch.float32, rank, step), values((4, 6), torch.float32, rank, step)[:, ::2],
                values((3,), torch.float32, rank, step)]
    for step in range(3):
        xs = members(hvd.rank(), step)
        group, count = started_through(fast, lambda: hvd.grouped_allreduce_async_(xs, name="fp.many.mixed",
                                                                                  op=hvd.Sum))
        results = hvd.synchronize(group)
        assert count == (0 if step == 0 else 2) and group_waits[-1] == 1, (step, count, group_waits)
        expected = [sum(m[i] for m in (members(r, step) for r in range(hvd.size()))) for i in range(3)]
        for got, x, e in zip(results, xs, expected):
            assert got is x
            exact(x, e)
        assert in_flight(group) == []


def test_a_group_refused_after_the_compiled_path_started_members_starts_none_and_the_process_goes_on(fast):
    # The third member repeats the first's name: the core refuses it, after
    # allreduce_many_ has started the first two (held by the group). None
    # runs: the tensors keep their values, no handle stays in flight, and
    # the same group then runs with every member's sum.
    names = ["fp.many.refused.a", "fp.many.refused.b"]
    for step in range(2):
        xs = [values((4,), torch.float32, hvd.rank(), step), values((2,), torch.float32, hvd.rank(), step)]
        hvd.synchronize(hvd.grouped_allreduce_async_(xs, name=names, op=hvd.Sum))
    xs = [values((4,), torch.float32, hvd.rank()), values((2,), torch.float32, hvd.rank()),
          values((4,), torch.float32, hvd.rank())]
    before_values, before_in_flight = [x.clone() for x in xs], set(handles._in_flight)
    with pytest.raises(unison.InvalidArgumentError, match=r"fp\.many\.refused\.a.*already in flight"):
        started_through(fast, lambda: hvd.grouped_allreduce_async_(xs, name=names + names[:1], op=hvd.Sum))
    assert set(handles._in_flight) == before_in_flight
    hvd.barrier()
    for x, before in zip(xs, before_values):
        exact(x, before)
    group, count = started_through(fast, lambda: hvd.grouped_allreduce_async_(xs[:2], name=names, op=hvd.Sum))
    hvd.synchronize(group)
    assert count == 2
    exact(xs[0], summed((4,), torch.float32))
    exact(xs[1], summed((2,), torch.float32))


def test_a_member_that_fails_stops_the_waiter_and_the_group_raises_its_error_after_the_rest_complete(
        fast, group_waits):
    names = ["fp.many.fails.%d" % i for i in range(3)]
    for step in range(2):
        hvd.synchronize(hvd.grouped_allreduce_async_([torch.ones(4) for _ in names], name=names, op=hvd.Sum))
    # Rank 0 repeats the learned shapes; the others change the middle one's.
    xs = [torch.ones(4), torch.ones(4 if hvd.rank() == 0 else 5), torch.ones(4)]
    group = hvd.grouped_allreduce_async_(xs, name=names, op=hvd.Sum)
    with pytest.raises(unison.MismatchError, match=r"fp\.many\.fails\.1.*shape"):
        hvd.synchronize(group)
    assert group_waits[-1] == 1
    exact(xs[0], torch.full((4,), float(hvd.size())))
    exact(xs[2], torch.full((4,), float(hvd.size())))
    assert in_flight(group) == []
    ys = [torch.ones(4) for _ in names]
    hvd.synchronize(hvd.grouped_allreduce_async_(ys, name=names, op=hvd.Sum))
    for y in ys:
        exact(y, torch.full((4,), float(hvd.size())))


class _Interrupted(Exception):
    pass


def test_a_signal_during_the_waiter_s_wait_raises_and_leaves_the_group_in_flight(fast, group_waits):
    # Rank 0 waits for a group the others have not started; a signal
    # handler that raises (as Ctrl-C's does) ends the wait between its
    # slices. The members stay in flight, their tensors with them, and
    # once the others start theirs the same group is synchronized.
    names = ["fp.many.signal.%d" % i for i in range(3)]
    for step in range(2):
        hvd.synchronize(hvd.grouped_allreduce_async_([torch.ones(4) for _ in names], name=names, op=hvd.Sum))
    xs = [torch.ones(4) * (i + 1) for i in range(len(names))]
    if hvd.rank() == 0:
        def interrupted(*_):
            raise _Interrupted()
        previous = signal.signal(signal.SIGUSR1, interrupted)
        try:
            group, count = started_through(fast, lambda: hvd.grouped_allreduce_async_(xs, name=names, op=hvd.Sum))
            assert count == len(names)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(_Interrupted):
                hvd.synchronize(group)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert sorted(in_flight(group)) == sorted(h.id for h in group.handles)
        hvd.barrier()
    else:
        hvd.barrier()
        group = hvd.grouped_allreduce_async_(xs, name=names, op=hvd.Sum)
    results = hvd.synchronize(group)
    assert group_waits[-1] == len(names)   # the compiled waiter finished them all
    for i, (got, x) in enumerate(zip(results, xs)):
        assert got is x
        exact(x, torch.full((4,), float((i + 1) * hvd.size())))
    assert in_flight(group) == []


def test_it_gives_what_the_python_path_gives(fast, monkeypatch):
    """The same ops with the compiled path and with the Python path forced
    (as UNISON_TORCH_FAST_PATH=0 forces it): equal bit for bit, with scale
    factors, every reduce op and a process set."""
    part = hvd.add_process_set(list(range(hvd.size() - 1))) if hvd.size() > 2 else hvd.global_process_set
    try:
        def run(prefix):
            results = []
            for op in [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum]:
                for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
                    if op == hvd.Adasum and (pre, post) != (1.0, 1.0):
                        continue
                    for process_set in {hvd.global_process_set: 1, part: 1}:   # one of each
                        if not process_set.included():
                            continue
                        for step in range(2):
                            x = values((6,), torch.float32, hvd.rank(), step) / 3
                            hvd.synchronize(hvd.allreduce_async_(
                                x, name="%s.%d.%g.%d" % (prefix, op, pre, process_set.process_set_id), op=op,
                                prescale_factor=pre, postscale_factor=post, process_set=process_set))
                            results.append(x)
            return results

        compiled, count = started_through(fast, lambda: run("fp.same"))
        assert count == len(compiled) // 2
        monkeypatch.setattr(ops, "_fast", None)
        monkeypatch.setattr(ops._front, "fast", None)
        before = fast.started()
        python = run("fp.same.python")
        assert fast.started() == before   # none of these went through it
        for a, b in zip(compiled, python):
            assert torch.equal(a, b), (a, b)
    finally:
        if part is not hvd.global_process_set:
            hvd.remove_process_set(part)


def test_tensors_whose_memory_is_not_the_tensor_go_the_python_way(fast):
    """Non-contiguous tensors, views whose sign is in a flag (z.conj(),
    and its imaginary part, negated) and subclasses: the compiled path
    takes none of them, and the Python path reduces each by its values."""
    cases = {
        "strided": lambda r: values((4, 6), torch.float32, r)[:, ::2],
        "conj": lambda r: torch.complex(values((3,), torch.float32, r), torch.full((3,), float(r))).conj(),
        "neg": lambda r: torch.complex(values((3,), torch.float32, r), torch.full((3,), float(r))).conj().imag,
        "subclass": lambda r: values((3,), torch.float32, r).as_subclass(_Subclass),
    }

    def plain(t):
        return t.resolve_conj().resolve_neg().as_subclass(torch.Tensor)
    for label, make in cases.items():
        expected = sum(plain(make(r)) for r in range(hvd.size()))
        for step in range(2):
            x = make(hvd.rank())
            _, count = started_through(fast, lambda: hvd.synchronize(
                hvd.allreduce_async_(x, name="fp.declined." + label, op=hvd.Sum)))
            assert count == 0, label
            torch.testing.assert_close(plain(x), expected, rtol=0, atol=0)


class _Subclass(torch.Tensor):
    pass


def test_a_mismatch_of_a_learned_op_fails_on_every_rank_naming_it_and_the_job_goes_on(fast):
    x = torch.ones(4)
    hvd.allreduce_(x, name="fp.mismatch", op=hvd.Sum)   # learned on every rank
    # Rank 0 repeats the learned op (the compiled path starts it); the
    # others change its shape (the Python path starts theirs).
    y = torch.ones(4 if hvd.rank() == 0 else 5)
    with pytest.raises(unison.MismatchError, match=r"fp\.mismatch.*shape"):
        hvd.synchronize(hvd.allreduce_async_(y, name="fp.mismatch", op=hvd.Sum))
    z = torch.ones(4)
    assert hvd.allreduce_(z, name="fp.mismatch", op=hvd.Sum) is z
    assert z.tolist() == [hvd.size()] * 4


def test_a_name_already_in_flight_is_refused_by_the_python_path_s_error(fast):
    # Each rank repeats its own name while the others hold theirs back
    # behind the barrier, so its first op cannot have completed yet. (One
    # shared name raced: a rank descheduled between its two calls could
    # find the first op done, and start a second the others never did.)
    me, n = hvd.rank(), hvd.size()
    tensors = [torch.ones(3) for _ in range(n)]
    for r in range(n):   # learned on every rank, so that the compiled path starts the repeats
        hvd.allreduce_(tensors[r], name="fp.twice.%d" % r, op=hvd.Sum)
    own, count = started_through(fast, lambda: hvd.allreduce_async_(tensors[me], name="fp.twice.%d" % me, op=hvd.Sum))
    assert count == 1
    with pytest.raises(unison.InvalidArgumentError, match=r"fp\.twice\.%d" % me):
        hvd.allreduce_async_(torch.ones(3), name="fp.twice.%d" % me, op=hvd.Sum)
    hvd.barrier()
    others = [hvd.allreduce_async_(tensors[r], name="fp.twice.%d" % r, op=hvd.Sum) for r in range(n) if r != me]
    for handle in [own] + others:
        hvd.synchronize(handle)
    assert [t.tolist() for t in tensors] == [[n ** 2] * 3] * n


def test_each_thread_learns_its_own_ops(fast):
    """As the Python path's prepared options, the compiled path's learned
    ops are per thread: a thread's first call of an op goes the Python
    way even where another thread has learned it."""
    counts = []

    def in_a_thread():
        for step in range(2):
            x = torch.ones(2)
            counts.append(started_through(fast, lambda: hvd.allreduce_(x, name="fp.thread", op=hvd.Sum))[1])
            assert x.tolist() == [hvd.size()] * 2
    for _ in range(2):
        t = threading.Thread(target=in_a_thread)
        t.start()
        t.join()
    assert counts == [0, 1, 0, 1], counts


# ---- DistributedOptimizer's gradient hook in C (fast_path.cc's GradientHook) ----

def make_mlp(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def hooks_of(parameter):
    return list(parameter._post_accumulate_grad_hooks.values())


def train(model, optimizer, steps=3):
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.arange(20, dtype=torch.float64).reshape(4, 5) / (7 + hvd.rank() + step)
        model(x).pow(2).sum().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_hooks_are_c_and_train_as_the_python_hooks_do(fast, monkeypatch):
    """The same model trained with the C hooks and with the optimizer's
    Python hooks (the compiled path off when the optimizer was made): equal
    bit for bit, every step's allreduces started by the hooks."""
    model = make_mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    assert {type(h).__name__ for p in model.parameters() for h in hooks_of(p)} == {"GradientHook"}
    before, hooked = fast.started(), fast.hooked()
    with_c_hooks = train(model, optimizer)
    # The first step learns each op in Python; the C hook starts the next two.
    assert fast.started() - before == fast.hooked() - hooked == 2 * len(with_c_hooks)

    twin = make_mlp()
    monkeypatch.setattr(ops, "_fast", None)
    twin_optimizer = hvd.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9),
                                              named_parameters=[("twin." + n, p) for n, p in twin.named_parameters()])
    monkeypatch.undo()
    assert {type(h).__name__ for p in twin.parameters() for h in hooks_of(p)} == {"function"}
    with_python_hooks = train(twin, twin_optimizer)
    for a, b in zip(with_c_hooks, with_python_hooks):
        assert torch.equal(a, b)


def test_what_the_c_hook_does_not_take_goes_to_the_python_hook(fast):
    """Accumulated passes, groups, compression, a predivide factor: each
    trains as one process on the whole batch would, through the Python
    hook the C one calls. A class or an object with its own version of what
    the hook calls keeps the Python hook, and its version runs."""
    def reference(passes=1):
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            optimizer.zero_grad()
            for k in range(passes):
                for rank in range(hvd.size()):
                    x = torch.arange(20, dtype=torch.float64).reshape(4, 5) / (7 + rank + step)
                    (model(x).pow(2).sum() / hvd.size() / passes).backward()
            optimizer.step()
        return [p.detach() for p in model.parameters()]

    def distributed(passes=1, **options):
        model = make_mlp()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=[("%s.%s" % (sorted(options), n), p)
                                                               for n, p in model.named_parameters()],
                                             backward_passes_per_step=passes, **options)
        for step in range(3):
            optimizer.zero_grad()
            for k in range(passes):
                x = torch.arange(20, dtype=torch.float64).reshape(4, 5) / (7 + hvd.rank() + step)
                (model(x).pow(2).sum() / passes).backward()
            optimizer.step()
        return [p.detach() for p in model.parameters()]

    runs = []
    for options in [{"passes": 2}, {"groups": 1}, {"gradient_predivide_factor": 2.0},
                    {"compression": hvd.Compression.fp16}]:
        hooked = fast.hooked()
        result = distributed(**options)
        runs.append((options, result, fast.hooked() - hooked))
    # Only the last of each step's passes is the C hook's; the rest are all the Python hook's.
    assert [hooked for _, _, hooked in runs] == [2 * len(runs[0][1]), 0, 0, 0], runs
    for options, result, _ in runs:
        # fp16 on the wire: within its precision.
        tolerance = 1e-3 if "compression" in options else 1e-12
        for a, b in zip(result, reference(options.get("passes", 1))):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)

    class Counting(type(hvd.DistributedOptimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1)))):
        pass
    calls = []

    def counted(self, p):
        calls.append(p)
        return Counting.__mro__[1]._allreduce_grad_async(self, p)
    Counting._allreduce_grad_async = counted
    model = make_mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=[("counting." + n, p) for n, p in model.named_parameters()])
    optimizer.__class__ = Counting
    optimizer_hooks = {type(h).__name__ for p in model.parameters() for h in hooks_of(p)}
    assert optimizer_hooks == {"GradientHook"}   # made before the class changed: it looks at each call
    hooked = fast.hooked()
    train(model, optimizer, steps=2)
    assert len(calls) == 2 * len(list(model.parameters())) and fast.hooked() == hooked, len(calls)
    calls.clear()
    optimizer.__class__ = Counting.__mro__[1]
    optimizer._wire_tensor = lambda p: (calls.append(p), Counting.__mro__[1]._wire_tensor(optimizer, p))[1]
    train(model, optimizer, steps=1)
    assert len(calls) == len(list(model.parameters())) and fast.hooked() == hooked, len(calls)


def test_a_dropped_optimizer_and_model_are_collected_with_their_c_hooks(fast):
    import gc
    import weakref

    def made():
        model = make_mlp()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=[("dropped." + n, p) for n, p in model.named_parameters()])
        train(model, optimizer, steps=2)
        return weakref.ref(next(model.parameters())), weakref.ref(optimizer)
    parameter, optimizer = made()
    gc.collect()
    assert parameter() is None and optimizer() is None
