"""Picklable objects between ranks, for every front end: an object travels
as its serialised bytes, a length first, so receivers can size their
buffers. Front ends pass their own serialiser where pickle is not the best
(torch.save keeps tensors compact)."""
import pickle

import numpy as np

from unison import basics
import unison.numpy as unp


def _to_bytes(obj, dumps):
    return np.frombuffer(dumps(obj), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=None, dumps=pickle.dumps, loads=pickle.loads):
    """root_rank's `obj` on every rank."""
    name = name or "broadcast_object"
    root = basics.rank() == root_rank
    payload = _to_bytes(obj, dumps).copy() if root else None
    length = np.array([payload.size if root else 0], dtype=np.int64)
    unp.broadcast_(length, root_rank, name=name + ".length", process_set=process_set)
    if not root:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    unp.broadcast_(payload, root_rank, name=name + ".payload", process_set=process_set)
    return obj if root else loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=None, dumps=pickle.dumps, loads=pickle.loads):
    """Every rank's `obj`, in rank order."""
    name = name or "allgather_object"
    payload = _to_bytes(obj, dumps)
    lengths = unp.allgather(np.array([payload.size], dtype=np.int64), name=name + ".lengths",
                            process_set=process_set)
    gathered = unp.allgather(payload, name=name + ".payload", process_set=process_set)
    objects, offset = [], 0
    for length in lengths.tolist():
        objects.append(loads(gathered[offset:offset + length].tobytes()))
        offset += length
    return objects
