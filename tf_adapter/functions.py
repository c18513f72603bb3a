"""Broadcasting variables and Python objects."""
import tensorflow as tf

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
    """Horovod's TF1 helper: in a TF1 graph (one run by a
    tf.compat.v1.Session), an op that sets every global variable to
    root_rank's value. Eagerly and inside a tf.function there is no global
    variable collection, so, as Horovod does, this refuses there with a
    pointer to what works instead, rather than broadcast nothing."""
    if tf.compat.v1.executing_eagerly_outside_functions():
        raise RuntimeError("unison: broadcast_global_variables() works only in a TF1 graph run by a "
                           "tf.compat.v1.Session; eagerly and in tf.function there are no global variables. Use "
                           "broadcast_variables(model.variables, root_rank) (and the optimizer's variables), or "
                           "hvd.callbacks.BroadcastGlobalVariablesCallback with Keras")
    return _global_variables_from(root_rank, global_process_set)


def _global_variables_from(root_rank, process_set):
    """One op that sets every global variable of the default graph to
    root_rank's value."""
    variables = tf.compat.v1.global_variables()
    return tf.group(*broadcast_variables(variables, root_rank, process_set), name="broadcast_global_variables")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's SessionRunHook for tf.compat.v1.train.MonitoredTrainingSession:
    once the session is created (variables initialized or restored from a
    checkpoint), every global variable is set to root_rank's value, so the
    ranks start from one model. `device` is accepted for Horovod
    compatibility and ignored, as everywhere in unison."""

    def __init__(self, root_rank, device="", process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op = None

    def begin(self):
        """Builds the broadcast op into the graph the session will run (again for a new graph)."""
        # The op is built into the graph being finalized for this session; a
        # hook reused with a new graph builds it again.
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            self.bcast_op = _global_variables_from(self.root_rank, self.process_set)

    def after_create_session(self, session, coord):
        """Runs the broadcast once the session has initialized or restored its variables."""
        session.run(self.bcast_op)
