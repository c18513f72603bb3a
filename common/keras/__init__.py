"""unison.keras: the same module as unison.tensorflow.keras (Keras 3 runs on
TensorFlow here), under the name `horovod.keras` users import."""
from unison.tensorflow.keras import *  # noqa: F401,F403
from unison.tensorflow.keras import (  # noqa: F401
    DistributedOptimizer, broadcast_global_variables, callbacks, load_model)
from unison.keras import elastic  # noqa: F401,E402
