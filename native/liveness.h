// liveness.h: keeping this process's heartbeats going on every plane at
// once.
//
// Peers judge a rank alive by its heartbeats on the plane they share with
// it: its word in shared memory, for ranks on its host; the heartbeat
// frames on its TCP connections, for ranks on other hosts. A host's leader
// in the hierarchical layout can wait on one plane for the whole peer
// timeout: on another host over TCP, or on a local rank in shared memory,
// when that rank is frozen. Beating only the plane it waits on, it looked
// frozen to the ranks that watch it on the other, just as the frozen rank
// did, and they named it instead. So each plane registers its beat here,
// and every wait loop beats them all.
#pragma once

#include <functional>

namespace unison {

// Registers `beat`, which beat_everywhere() calls until it is removed; the
// id is for remove_beat. Beats run on the thread that waits (the engine's,
// or a caller driving it) and must not block.
int add_beat(std::function<void()> beat);
void remove_beat(int id);

// Calls every beat registered.
void beat_everywhere();

}  // namespace unison
