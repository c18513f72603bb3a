"""unison.keras.elastic: the same as unison.tensorflow.keras.elastic."""
from unison.tensorflow.keras.elastic import (  # noqa: F401
    CommitStateCallback, HostsUpdatedInterrupt, KerasState, ObjectState, State, TensorFlowKerasState,
    TensorFlowState, UpdateBatchStateCallback, UpdateEpochStateCallback, run)
