"""An elastic MXNet Gluon job (MXNetState over a DistributedTrainer): the
fixed global batches of reference.py, each rank training on its share of
every step's batch, committed after every step."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import fault_at, log, maybe_add_host, wait_for_growth  # noqa: E402
from reference import BATCH, LEARNING_RATE, MOMENTUM, STEPS, batch_of, make_mxnet_model  # noqa: E402

import mxnet as mx  # noqa: E402

import unison.mxnet as hvd  # noqa: E402


def main():
    hvd.init()
    net = make_mxnet_model()
    params = net.collect_params()
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM})
    state = hvd.elastic.MXNetState(params, trainer, step=0)

    @hvd.elastic.run
    def train(state):
        log(event="sync", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            maybe_add_host(state.step, hvd.rank())
            wait_for_growth(state.step, hvd.size(), state.commit)
            inputs, targets = (mx.nd.array(a[hvd.rank()::hvd.size()]) for a in batch_of(state.step))
            with mx.autograd.record():
                loss = ((net(inputs) - targets) ** 2).sum()
            loss.backward()
            fault_at(state.step)
            trainer.step(BATCH // hvd.size())
            state.step += 1
            time.sleep(0.02)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        log(event="final", size=hvd.size(), step=state.step,
            params={"weight": net.weight.data().asnumpy().flatten().tolist(),
                    "bias": net.bias.data().asnumpy().flatten().tolist()})
    log(event="done", rank=hvd.rank(), size=hvd.size())


if __name__ == "__main__":
    main()
