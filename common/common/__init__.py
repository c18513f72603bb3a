"""Horovod's `horovod.common` import paths, so that code written against
them keeps working with `horovod` replaced by `unison`:

    from unison.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    from unison.common.util import nccl_built
    from unison.common.process_sets import ProcessSet, global_process_set
    from unison.common.elastic import ObjectState, run_fn

Each module only names what lives elsewhere in unison: new code imports it
from `unison` itself."""
