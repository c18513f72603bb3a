// segment.h: the POSIX shared-memory segment the ranks of one host share.
//
// Layout, one mapping per rank:
//   Header                      magic, sizes, the cycle counter, the barrier bell
//   RankArea x size             each rank's barrier step, heartbeat, pid, bell
//   mailboxes: size x 2 halves  control messages (negotiation)
//   slots:     size x 2 halves  data staged for collectives
// Two halves of each so that round k+1 can be written while peers still
// read round k: a write into a half always follows a barrier that every
// reader of that half's previous contents has passed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "../config.h"
#include "../futex.h"
#include "../status.h"

namespace unison {

// Room for the reason a rank stopped, as peers read it (RankArea).
constexpr size_t kStoppedOnBytes = 1024;

struct alignas(64) RankArea {
  std::atomic<uint64_t> arrived;           // barrier steps this rank has reached
  std::atomic<int64_t> heartbeat_ns;       // CLOCK_MONOTONIC, same clock host-wide
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> message_bytes[2];  // length of the message in each mailbox half
  std::atomic<uint32_t> left;              // set when this rank's backend is destroyed (shutdown), or it stopped
  // Why this rank's engine stopped (Backend::stopped_on): the status code,
  // written after the text, and 0 while it runs.
  std::atomic<int32_t> stopped_code;
  char stopped_on[kStoppedOnBytes];
  alignas(64) Doorbell bell;               // wakes this rank's engine thread
};

struct Header {
  std::atomic<uint64_t> magic;
  uint32_t size;
  uint32_t unused;
  uint64_t slot_half_bytes;
  uint64_t message_half_bytes;
  uint64_t total_bytes;
  std::atomic<uint32_t> name_removed;  // set once local rank 0 unlinked the name
  alignas(64) std::atomic<uint64_t> requested_cycles;
  alignas(64) Doorbell barrier_bell;  // rung by every barrier arrival
};

class ShmSegment {
 public:
  ~ShmSegment();
  // Local rank 0 creates the segment (mode 0600); the others open it. When
  // every rank has attached, the name is unlinked: the memory lives on in
  // the mappings and disappears with the last of them, even after a crash.
  // `hear_creator`, when given, runs on every rank between local rank 0's
  // attempt to create and the others' attempt to open, is given this rank's
  // own status and returns local rank 0's: a process set's members learn
  // through the job's control plane that it failed (no room in /dev/shm)
  // instead of waiting for a segment that will never exist.
  using HearCreator = std::function<Status(const Status& mine)>;
  // `watch`, when given, runs while this rank waits for the others; an
  // error from it ends the wait. A job across hosts has its TCP connections
  // by then, and a local rank that gave up or died closed its own: without
  // that, the others would wait for it until UNISON_START_TIMEOUT.
  using StartWatch = std::function<Status()>;
  Status open(const Config& config, int generation, const HearCreator& hear_creator = nullptr,
              const StartWatch& watch = nullptr);

  Header* header() const { return header_; }
  RankArea* rank_area(int rank) const { return areas_ + rank; }
  char* mailbox(int rank, int half) const {
    return base_ + mailbox_offset_ + ((size_t)rank * 2 + half) * header_->message_half_bytes;
  }
  char* slot(int rank, int half) const {
    return base_ + slot_offset_ + ((size_t)rank * 2 + half) * header_->slot_half_bytes;
  }
  const std::string& name() const { return name_; }

 private:
  Status open_watched(const Config& config, int generation, const HearCreator& hear_creator);
  Status create(size_t total_bytes, double deadline);
  Status attach(size_t total_bytes, double deadline);
  Status wait_for_everyone(const Config& config, double deadline);
  Status pause_watching();
  std::string no_room_message(size_t total_bytes, int error) const;

  std::string name_;
  char* base_ = nullptr;
  size_t mapped_bytes_ = 0;
  Header* header_ = nullptr;
  RankArea* areas_ = nullptr;
  size_t mailbox_offset_ = 0;
  size_t slot_offset_ = 0;
  bool unlinked_ = false;
  int local_size_ = 0;
  size_t per_rank_bytes_ = 0;  // mailboxes and slot
  StartWatch watch_;            // during open() only
};

int64_t monotonic_nanoseconds();

}  // namespace unison
