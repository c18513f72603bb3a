"""horovod.common.exceptions: the errors an elastic training loop catches."""
from unison.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
