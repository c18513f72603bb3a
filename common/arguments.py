"""The arguments of the collectives, checked and named the same way in every
front end: which reduce ops each collective takes, scale factors, splits,
the names of grouped tensors, how reducescatter divides rows, and how the
optimizer wrappers split gradients into groups and scale an average.

Everything here raises before anything is sent, so a bad call fails on the
rank that made it, at the call, and leaves the job usable.
"""
import functools
import numbers

from unison.dtypes import label
from unison.exceptions import InvalidArgumentError, UnsupportedError

from unison.basics import Adasum, Average, Max, Min, Product, Sum  # noqa: E402,F401  (hvd.Sum, ... as Horovod's)
_OP_NAMES = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max", Product: "Product", Adasum: "Adasum"}

# The reduce ops each reducing collective accepts.
ALLREDUCE_OPS = (Sum, Average, Min, Max, Product, Adasum)
REDUCESCATTER_OPS = (Sum, Average, Min, Max, Product)


def op_name(op):
    return _OP_NAMES.get(op, repr(op))


def resolve_op(op, average, default=Average):
    """Horovod's rules: `op` wins; the deprecated `average` flag maps to
    Average or Sum; neither means the default. The first test is the
    common case (every gradient's allreduce names its op), so it is first."""
    if average is None and op is not None:
        return op
    if op is not None and average is not None:
        raise InvalidArgumentError("unison: give op or the deprecated average, not both")
    if op is not None:
        return op
    if average is not None:
        return Average if average else Sum
    return default


def check_reduce(collective, op, prescale_factor, postscale_factor, name):
    """Raises unless `collective` ('allreduce', 'reducescatter') takes `op`
    with these factors."""
    accepted = ALLREDUCE_OPS if collective == "allreduce" else REDUCESCATTER_OPS
    if op not in accepted:
        raise InvalidArgumentError("unison: %s of %s: op %s is not one of %s" % (
            collective, label(name), op_name(op), ", ".join(op_name(o) for o in accepted)))
    if op == Adasum and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise InvalidArgumentError("unison: %s of %s: Adasum takes no prescale or postscale factor"
                                   % (collective, label(name)))


def check_has_rows(collective, shape, name):
    """allgather, alltoall and reducescatter work on a first dimension."""
    if len(shape) == 0:
        raise InvalidArgumentError("unison: %s of %s needs a tensor with at least one dimension, got a scalar"
                                   % (collective, label(name)))


def split_counts(splits, name, collective="alltoall"):
    """alltoall's or reducescatter's splits as a list of Python ints.
    Anything that is not an integer (2.5, '3', a float tensor) is a
    ValueError here rather than a truncated or overflowing count later."""
    if splits is None:
        return None
    if hasattr(splits, "tolist"):   # numpy arrays, torch tensors, eager TF tensors via numpy()
        splits = splits.tolist()
    if isinstance(splits, numbers.Integral):
        splits = [splits]
    counts = []
    for s in splits:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise InvalidArgumentError("unison: %s of %s: splits must be integers, got %r"
                                       % (collective, label(name), list(splits)))
        counts.append(int(s))
    return counts


def member_name(name, index):
    """The core's name for member `index` of a grouped op named `name`;
    None (numbered by the core in program order) when the group is unnamed."""
    return None if name is None else "%s.%d" % (name, index)


def member_names(name, count):
    """The core's names for the `count` members of a grouped op: `name`
    itself for a group of one (so a lone collective and a group of one are
    the same op), name.i for more; a list of names is taken as it is."""
    if isinstance(name, (list, tuple)):
        return list(name)
    if count == 1:
        return [name]
    if isinstance(name, str):
        return list(_numbered_names(name, count))
    return [member_name(name, i) for i in range(count)]


@functools.lru_cache(maxsize=256)
def _numbered_names(name, count):
    """name.0 ... name.(count-1), made once: a training loop's grouped calls
    repeat the same name every step, and formatting 200 names took a quarter
    of a grouped allreduce's start (0.2 of 0.8 us a tensor, at 1 rank)."""
    return tuple(member_name(name, i) for i in range(count))


def scatter_rows(rows, size, rank):
    """Rows of a reducescatter's first dimension that `rank` keeps: as even
    as possible, the first ranks taking one more when it does not divide."""
    return rows // size + (1 if rank < rows % size else 0)


def split_list(items, num_parts):
    """`items` cut into num_parts consecutive parts whose lengths differ by
    at most one, the first ones longer; parts beyond the items are empty
    (horovod.common.util.split_list)."""
    base, longer = divmod(len(items), num_parts)
    parts, start = [], 0
    for part in range(num_parts):
        end = start + base + (1 if part < longer else 0)
        parts.append(items[start:end])
        start = end
    return parts


def split_into_groups(items, num_groups):
    """split_list's parts, empty ones left out: Horovod's num_groups for
    the optimizer wrappers of every framework (0: no groups)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups < 0:
        raise ValueError("num_groups must be a non-negative integer, got %r" % (num_groups,))
    return [group for group in split_list(items, num_groups) if group] if num_groups else []


def gradient_scaling(op, gradient_predivide_factor):
    """(prescale, postscale) for reducing gradients with `op`: a predivide
    factor f splits Average's division into 1/f before the sum and f/size
    after it (the core divides by the size), so that large gradients are
    divided before they are added."""
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0
