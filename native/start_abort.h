// start_abort.h: ending a start-up from another thread.
//
// An elastic worker starts in a round its driver formed. When a member of
// that round dies before it reached the others, no wait of this rank's can
// tell: there is no connection or shared memory of the dead one's to see
// close. The driver saw it die, and the worker's watch on the driver
// (common/elastic_worker.py) says so through unison_abort_start. Start-up's
// waits (tcp/socket.cc, shm/segment.cc) look here between short sleeps.
#pragma once

#include <string>

#include "status.h"

namespace unison {

// unison_init brackets the backend's start-up with these.
void start_up_begins();
void start_up_ends();

// Ends the start-up in progress with `reason`; does nothing when none is.
void abort_start_up(const std::string& reason);

// OK, or the error that ends the start-up in progress.
Status start_up_aborted();

}  // namespace unison
