"""Picklable objects between ranks, for every front end: an object travels
as its serialised bytes, a length first, so receivers can size their
buffers. Front ends pass their own serialiser where pickle is not the best
(torch.save keeps tensors compact).

Pickle sends functions and classes by name; what has no name the other
ranks could import (a lambda, a closure, a function typed into a notebook)
goes by value through cloudpickle where it is installed, as Horovod sends
every object. Pickle is tried first because it is the faster of the two on
large state; both make streams that pickle reads back.

A rank whose object cannot be serialised either way (an open file, a lock)
still takes part: it sends why instead, marked by a negative length, and
every rank raises. Raising on that rank alone would leave the others
waiting in the collective it never joined until the deadlock watch gave up
on them, with no word of the reason."""
import pickle

import numpy as np

from unison import basics
from unison.exceptions import InvalidArgumentError
from unison.runner.function import cloudpickle_or_none
import unison.numpy as unp


def _pickled(obj, pickle_module):
    return pickle_module.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _serialised(obj, dumps):
    """(bytes as uint8, None), or (why it failed as utf-8 uint8, the
    exception). dumps(obj, pickle_module) serialises with that module's
    Pickler."""
    try:
        return np.frombuffer(dumps(obj, pickle), dtype=np.uint8), None
    except Exception as e:
        failure = e
    by_value = cloudpickle_or_none()
    if by_value is not None:
        try:
            return np.frombuffer(dumps(obj, by_value), dtype=np.uint8), None
        except Exception as e:
            failure = e
    return np.frombuffer(("%s: %s" % (type(failure).__name__, failure)).encode(), dtype=np.uint8), failure


def _marked(length, failed):
    # -1 - n marks n bytes of a failure's text, so an empty one stays negative.
    return -1 - length if failed else length


def _unmarked(length):
    return (-1 - length, True) if length < 0 else (length, False)


def _refused(what, name, why_by_rank, mine):
    """Raises on every rank once `why_by_rank` ({rank: text}) has failures:
    on a failing rank, its own exception (`mine`); on the others, an error
    naming the failing ranks and their reasons."""
    if mine is not None:
        raise mine
    ranks = sorted(why_by_rank)
    reasons = "; ".join("rank %d: %s" % (r, why_by_rank[r]) for r in ranks)
    raise InvalidArgumentError(
        "unison: %s '%s': the object of rank%s %s could not be serialised, so no rank received any (%s)"
        % (what, name, "s" if len(ranks) > 1 else "", ", ".join(map(str, ranks)), reasons))


def broadcast_object(obj, root_rank=0, name=None, process_set=None, dumps=_pickled, loads=pickle.loads):
    """root_rank's `obj` on every rank."""
    name = name or "broadcast_object"
    root = basics.rank() == root_rank
    payload, failure = _serialised(obj, dumps) if root else (None, None)
    if root:
        payload = payload.copy()  # broadcast_ writes into it; frombuffer's view is read-only
    length = np.array([_marked(payload.size, failure is not None) if root else 0], dtype=np.int64)
    unp.broadcast_(length, root_rank, name=name + ".length", process_set=process_set)
    size, failed = _unmarked(int(length[0]))
    if not root:
        payload = np.empty(size, dtype=np.uint8)
    unp.broadcast_(payload, root_rank, name=name + ".payload", process_set=process_set)
    if failed:
        _refused("broadcast_object", name, {root_rank: payload.tobytes().decode(errors="replace")}, failure)
    return obj if root else loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=None, dumps=_pickled, loads=pickle.loads):
    """Every rank's `obj`, in rank order."""
    name = name or "allgather_object"
    payload, failure = _serialised(obj, dumps)
    lengths = unp.allgather(np.array([_marked(payload.size, failure is not None)], dtype=np.int64),
                            name=name + ".lengths", process_set=process_set)
    gathered = unp.allgather(payload, name=name + ".payload", process_set=process_set)
    members = process_set._ranks() if process_set is not None else range(basics.size())
    pieces, failures, offset = [], {}, 0
    for member, marked in zip(members, lengths.tolist()):
        length, failed = _unmarked(marked)
        piece = gathered[offset:offset + length].tobytes()
        offset += length
        if failed:
            failures[member] = piece.decode(errors="replace")
        pieces.append(piece)
    if failures:
        _refused("allgather_object", name, failures, failure)
    return [loads(piece) for piece in pieces]
