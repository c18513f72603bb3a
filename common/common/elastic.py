"""horovod.common.elastic: the framework-free state and the retry loop."""
from unison.elastic import ObjectState, State, run_fn  # noqa: F401
