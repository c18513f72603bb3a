"""unison.keras.callbacks: the same callbacks as unison.tensorflow.keras.callbacks."""
from unison.tensorflow.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback, MetricAverageCallback)
