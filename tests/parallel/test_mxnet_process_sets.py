"""unison.mxnet with process sets: the collectives, DistributedTrainer,
DistributedOptimizer and broadcast_parameters among the ranks of one half of
the job (the `half` fixture, conftest.py). tests/test_parallel.py runs this at 2, 3 and 4 ranks."""
import pytest

mx = pytest.importorskip("mxnet")
import numpy as np  # noqa: E402

import unison  # noqa: E402
import unison.mxnet as hvd  # noqa: E402




def test_collectives_in_a_set(half):
    me = hvd.rank()
    total = hvd.allreduce(mx.nd.full((3,), float(me)), op=hvd.Sum, name="mps.ar", process_set=half)
    assert total.asnumpy().tolist() == [float(sum(half.ranks))] * 3
    gathered = hvd.allgather(mx.nd.full((me + 1,), me, dtype="int32"), name="mps.ag", process_set=half)
    assert gathered.asnumpy().tolist() == [r for r in half.ranks for _ in range(r + 1)]
    root = hvd.broadcast(mx.nd.array([me, me]), root_rank=half.ranks[-1], name="mps.bc", process_set=half)
    assert root.asnumpy().tolist() == [float(half.ranks[-1])] * 2
    received, splits = hvd.alltoall(mx.nd.arange(half.size()) + 10 * me, splits=[1] * half.size(),
                                    name="mps.a2a", process_set=half)
    assert received.asnumpy().tolist() == [float(10 * r + half.rank()) for r in half.ranks]
    assert splits.asnumpy().tolist() == [1] * half.size()
    part = hvd.reducescatter(mx.nd.ones((2 * half.size(),)), op=hvd.Sum, name="mps.rs", process_set=half)
    assert part.asnumpy().tolist() == [float(half.size())] * 2
    outs = hvd.grouped_allreduce([mx.nd.array([1.0]), mx.nd.array([float(me)])], op=hvd.Sum, name="mps.g",
                                 process_set=half)
    assert [o.asscalar() for o in outs] == [half.size(), sum(half.ranks)]
    hvd.barrier(process_set=half)


def test_trainer_and_optimizer_average_over_the_set(half):
    me = hvd.rank()
    mean = np.mean(half.ranks)
    for kind in ["trainer", "optimizer"]:
        net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
        net.initialize(mx.init.Constant(1.0))
        params = net.collect_params()
        if me != half.ranks[0]:
            list(params.values())[0].set_data(mx.nd.full((1, 2), 5.0))
        hvd.broadcast_parameters(params, root_rank=half.ranks[0], prefix="mps.%s." % kind, process_set=half)
        if kind == "trainer":
            trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.5}, prefix="mps.t.",
                                             process_set=half)
        else:
            optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5), process_set=half)
            trainer = mx.gluon.Trainer(params, optimizer, kvstore=None)
        x = mx.nd.array([[float(me), 1.0]])
        with mx.autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(1)
        weight = list(params.values())[0].data().asnumpy()
        np.testing.assert_allclose(weight, [[1.0 - 0.5 * mean, 1.0 - 0.5]], rtol=0, atol=1e-6)


def test_a_trainer_and_an_optimizer_of_a_set_step_locally_outside_it(half):
    """As in Horovod, a script builds one trainer or optimizer of a set on
    every rank and steps it everywhere: the set's ranks average over it, a
    rank outside it steps on its own gradient, as a plain trainer."""
    me = hvd.rank()
    for chosen in [s for s in unison.process_sets._registered.values() if s.ranks is not None]:
        gradient = np.mean(chosen.ranks) if chosen.included() else float(me)
        for kind in ["trainer", "optimizer"]:
            net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
            net.initialize(mx.init.Constant(1.0))
            params = net.collect_params()
            prefix = "mps.local.%d.%s." % (chosen.process_set_id, kind)
            if kind == "trainer":
                trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.5}, prefix=prefix,
                                                 process_set=chosen)
            else:
                optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5), process_set=chosen)
                trainer = mx.gluon.Trainer(params, optimizer, kvstore=None)
            with mx.autograd.record():
                loss = net(mx.nd.array([[float(me), 1.0]])).sum()
            loss.backward()
            trainer.step(1)
            weight = list(params.values())[0].data().asnumpy()
            np.testing.assert_allclose(weight, [[1.0 - 0.5 * gradient, 1.0 - 0.5]], rtol=0, atol=1e-6)


def test_ranks_outside_a_set_are_refused(half):
    for other in [s for s in unison.process_sets._registered.values() if s.ranks is not None and not s.included()]:
        message = "rank %d is not in process set %d" % (hvd.rank(), other.process_set_id)
        with pytest.raises(ValueError, match=message):
            hvd.allreduce(mx.nd.ones((2,)), name="mps.outsider", process_set=other)

