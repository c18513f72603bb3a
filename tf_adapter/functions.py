"""Broadcasting variables and Python objects."""
from unison import objects
from unison.process_sets import global_process_set
from unison.tensorflow.ops import broadcast_


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=None):
    """Sets every variable to root_rank's value (one collective node for
    all of them, so they fuse). Works eagerly and inside tf.function.
    `inplace` is accepted for Horovod compatibility: assignment is always
    in place here."""
    return broadcast_(list(variables), root_rank, name="broadcast_variables", process_set=process_set)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """root_rank's picklable `obj` on every rank."""
    return objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Horovod's factory: a function of one object that returns root_rank's
    object on every rank, for code that is handed a broadcast function."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's picklable `obj`, in rank order."""
    return objects.allgather_object(obj, name=name, process_set=process_set)


def broadcast_global_variables(root_rank):
    """Horovod's TF1 helper. TensorFlow 2 runs eagerly and keeps no global
    variable collection, so, as Horovod does in eager mode, this refuses
    with a pointer to what works instead."""
    raise RuntimeError("unison: broadcast_global_variables() does not work in eager mode, which has no global "
                       "variables; use broadcast_variables(model.variables, root_rank) (and the optimizer's "
                       "variables), or hvd.callbacks.BroadcastGlobalVariablesCallback with Keras")
