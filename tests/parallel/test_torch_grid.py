"""The shared grid (shared_grid.py) for unison.torch: torch tensors in and
out, through every form Horovod's torch API has."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ml_dtypes  # noqa: E402

import unison.torch as hvd  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402

torch.set_num_threads(1)

ALL = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
       "float32", "float64"]


def _ps(process_set):
    return hvd.global_process_set if process_set is None else process_set


class TorchShim(Shim):
    name = "torch"
    hvd = hvd
    dtypes = ALL + ["bool"]
    reduce_dtypes = ALL

    def tensor(self, array):
        if array.dtype == ml_dtypes.bfloat16:  # numpy's bfloat16 is not torch's
            return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(array))

    def numpy(self, tensor):
        if tensor.dtype == torch.bfloat16:
            return tensor.float().numpy().astype(ml_dtypes.bfloat16)
        return tensor.numpy()

    def allreduce_forms(self):
        def sync(x, op, name, pre, post, ps):
            return hvd.allreduce(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                 process_set=_ps(ps))

        def asynchronous(x, op, name, pre, post, ps):
            return hvd.synchronize(hvd.allreduce_async(x, op=op, name=name, prescale_factor=pre,
                                                       postscale_factor=post, process_set=_ps(ps)))

        def in_place(x, op, name, pre, post, ps):
            assert hvd.allreduce_(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                  process_set=_ps(ps)) is x
            return x

        def in_place_async(x, op, name, pre, post, ps):
            assert hvd.synchronize(hvd.allreduce_async_(x, op=op, name=name, prescale_factor=pre,
                                                        postscale_factor=post, process_set=_ps(ps))) is x
            return x

        def grouped(x, op, name, pre, post, ps):
            return hvd.grouped_allreduce([x], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                         process_set=_ps(ps))[0]

        def grouped_in_place(x, op, name, pre, post, ps):
            hvd.grouped_allreduce_([x], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                   process_set=_ps(ps))
            return x
        return {"sync": sync, "async": asynchronous, "in_place": in_place, "in_place_async": in_place_async,
                "grouped": grouped, "grouped_in_place": grouped_in_place}

    def grouped_allreduce(self, xs, op, name, ps):
        return hvd.grouped_allreduce(xs, op=op, name=name, process_set=_ps(ps))

    def allgather_forms(self):
        return {"sync": lambda x, name, ps: hvd.allgather(x, name=name, process_set=_ps(ps)),
                "async": lambda x, name, ps: hvd.synchronize(hvd.allgather_async(x, name=name,
                                                                                 process_set=_ps(ps)))}

    def grouped_allgather(self, xs, name, ps):
        return hvd.grouped_allgather(xs, name=name, process_set=_ps(ps))

    def broadcast_forms(self):
        def in_place(x, root, name, ps):
            assert hvd.broadcast_(x, root, name=name, process_set=_ps(ps)) is x
            return x
        return {"sync": lambda x, root, name, ps: hvd.broadcast(x, root, name=name, process_set=_ps(ps)),
                "async": lambda x, root, name, ps: hvd.synchronize(hvd.broadcast_async(x, root, name=name,
                                                                                       process_set=_ps(ps))),
                "in_place": in_place}

    def alltoall(self, x, splits, name, ps):
        out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                     process_set=_ps(ps))
        return out, received.tolist()

    def alltoall_even(self, x, name, ps):
        return hvd.alltoall(x, name=name, process_set=_ps(ps))

    def reducescatter_forms(self):
        return {"sync": lambda x, op, name, ps: hvd.reducescatter(x, op=op, name=name, process_set=_ps(ps)),
                "async": lambda x, op, name, ps: hvd.synchronize(hvd.reducescatter_async(
                    x, op=op, name=name, process_set=_ps(ps)))}

    def grouped_reducescatter(self, xs, op, name, ps):
        return hvd.grouped_reducescatter(xs, op=op, name=name, process_set=_ps(ps))

    def barrier(self, ps):
        hvd.barrier(process_set=_ps(ps))


SHIM = TorchShim()
