#include "segment.h"
#include "../start_abort.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

namespace unison {
namespace {

constexpr uint64_t kMagic = 0x756e69736f6e3031ull;  // "unison01"

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string errno_text() { return std::strerror(errno); }

void pause_briefly() { std::this_thread::sleep_for(std::chrono::milliseconds(1)); }

std::string mebibytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1 << 20));
  return text;
}

}  // namespace

int64_t monotonic_nanoseconds() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) munmap(base_, mapped_bytes_);
  // Only reached unlinked==false if init failed part-way; don't leave it.
  if (!unlinked_ && !name_.empty() && header_ != nullptr) shm_unlink(name_.c_str());
}

Status ShmSegment::pause_watching() {
  pause_briefly();
  if (Status aborted = start_up_aborted(); !aborted.ok()) return aborted;
  return watch_ ? watch_() : Status::OK();
}

Status ShmSegment::open(const Config& config, int generation, const HearCreator& hear_creator,
                        const StartWatch& watch) {
  watch_ = watch;
  Status s = open_watched(config, generation, hear_creator);
  watch_ = nullptr;
  return s;
}

Status ShmSegment::open_watched(const Config& config, int generation, const HearCreator& hear_creator) {
  name_ = "/unison-" + config.job_id + "-" + std::to_string(config.local_size) + "-g" +
          std::to_string(generation);
  const size_t size = (size_t)config.local_size;
  const size_t message_half = round_up(config.control_message_bytes, 4096);
  const size_t slot_half = round_up(config.shm_slot_bytes / 2, 4096);
  const size_t header_bytes = round_up(sizeof(Header) + size * sizeof(RankArea), 4096);
  mailbox_offset_ = header_bytes;
  slot_offset_ = mailbox_offset_ + size * 2 * message_half;
  const size_t total = slot_offset_ + size * 2 * slot_half;
  local_size_ = config.local_size;
  per_rank_bytes_ = 2 * (message_half + slot_half);
  const double deadline = monotonic_seconds() + config.start_timeout_seconds;

  Status s = config.local_rank == 0 ? create(total, deadline) : Status::OK();
  if (hear_creator) s = hear_creator(s);
  if (s.ok() && config.local_rank != 0) s = attach(total, deadline);
  if (!s.ok()) return s;
  if (config.local_rank == 0) {
    header_->size = (uint32_t)size;
    header_->slot_half_bytes = slot_half;
    header_->message_half_bytes = message_half;
    header_->total_bytes = total;
    header_->magic.store(kMagic, std::memory_order_release);
  } else {
    while (header_->magic.load(std::memory_order_acquire) != kMagic) {
      if (monotonic_seconds() > deadline)
        return Status::Error(UNISON_ERR_INTERNAL, "unison: shared memory " + name_ +
                                                      " was never initialised by local rank 0");
      if (Status watched = pause_watching(); !watched.ok()) return watched;
    }
    if (header_->size != size || header_->total_bytes != total)
      return Status::Error(UNISON_ERR_INVALID_ARGUMENT,
                           "unison: local rank 0 laid out shared memory for " +
                               std::to_string(header_->size) + " ranks and " +
                               std::to_string(header_->total_bytes) + " bytes, this rank expected " +
                               std::to_string(size) + " ranks and " + std::to_string(total) +
                               " bytes: are all ranks started with the same UNISON_* settings?");
  }
  areas_ = reinterpret_cast<RankArea*>(base_ + sizeof(Header));
  return wait_for_everyone(config, deadline);
}

namespace {

// Why a segment of this name that someone else made must not be used, or ""
// when it is this user's own and private. Another local user who knows the
// name could otherwise make it first, with a valid-looking header, and read
// or write every collective that goes through it.
std::string not_ours(const std::string& name, const struct stat& st) {
  if (st.st_uid == geteuid() && (st.st_mode & 077) == 0) return "";
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", (unsigned)(st.st_mode & 07777));
  return "unison: shared memory " + name + " exists already and belongs to uid " + std::to_string(st.st_uid) +
         " with mode " + mode + ", not to this user (uid " + std::to_string(geteuid()) +
         ") alone: another user made it; the job will not use it, nor remove it";
}

}  // namespace

Status ShmSegment::create(size_t total, double deadline) {
  int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left by a crashed earlier attempt of this job, which is ours to
    // remove; anyone else's is refused, and left where it is.
    struct stat st;
    if (stat(("/dev/shm" + name_).c_str(), &st) == 0) {
      std::string why = not_ours(name_, st);
      if (!why.empty()) return Status::Error(UNISON_ERR_INTERNAL, why);
    }
    shm_unlink(name_.c_str());
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) return Status::Error(UNISON_ERR_INTERNAL, "unison: cannot create shared memory " + name_ + ": " + errno_text());
  if (ftruncate(fd, (off_t)total) != 0) {
    std::string why = errno_text();
    close(fd);
    shm_unlink(name_.c_str());
    return Status::Error(UNISON_ERR_INTERNAL, "unison: cannot size shared memory " + name_ + " to " +
                                                  std::to_string(total) + " bytes: " + why);
  }
  // ftruncate only sets the size: tmpfs finds a page when it is first
  // touched, and a page it has no room for kills the toucher with SIGBUS, in
  // the middle of a collective. /dev/shm is often small (64 MiB in a Docker
  // container) and shared with others (DataLoader workers pass batches
  // through it). Taking every page now turns that crash into an error at
  // init that says what is missing, as NCCL does for its segments.
  if (int rc = posix_fallocate(fd, 0, (off_t)total); rc != 0) {
    close(fd);
    shm_unlink(name_.c_str());
    return Status::Error(UNISON_ERR_INTERNAL, no_room_message(total, rc));
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name_.c_str());
    return Status::Error(UNISON_ERR_INTERNAL, "unison: cannot map shared memory: " + errno_text());
  }
  (void)deadline;
  base_ = static_cast<char*>(p);
  mapped_bytes_ = total;
  // ftruncate zero-filled the memory, which is a valid state for every
  // atomic in it; construct the objects formally all the same.
  header_ = new (base_) Header();
  return Status::OK();
}

std::string ShmSegment::no_room_message(size_t total, int error) const {
  std::string message = "unison: cannot reserve " + mebibytes((double)total) + " of shared memory for " + name_ +
                        " (" + std::to_string(local_size_) + " ranks of this host, " +
                        mebibytes((double)per_rank_bytes_) + " each): " + std::strerror(error);
  struct statvfs fs;
  if (error == ENOSPC && statvfs("/dev/shm", &fs) == 0)
    message += "; /dev/shm has " + mebibytes((double)fs.f_bavail * fs.f_frsize) + " free of " +
               mebibytes((double)fs.f_blocks * fs.f_frsize) +
               ". Give it more room (docker run --shm-size=1g; on Kubernetes, an emptyDir of medium Memory "
               "mounted at /dev/shm), or take less: each rank takes UNISON_SHM_SLOT_BYTES plus twice "
               "UNISON_CONTROL_MESSAGE_BYTES, and each process set as much again for its members";
  return message;
}

Status ShmSegment::attach(size_t total, double deadline) {
  for (;;) {
    int fd = shm_open(name_.c_str(), O_RDWR, 0600);
    if (fd < 0 && errno == EACCES) {  // there, and not readable by this user: someone else's
      struct stat st;
      std::string why;
      if (stat(("/dev/shm" + name_).c_str(), &st) == 0) why = not_ours(name_, st);
      if (!why.empty()) return Status::Error(UNISON_ERR_INTERNAL, why);
    }
    if (fd >= 0) {
      struct stat st;
      const bool stated = fstat(fd, &st) == 0;
      std::string why = stated ? not_ours(name_, st) : "";
      if (!why.empty()) {
        close(fd);
        return Status::Error(UNISON_ERR_INTERNAL, why);
      }
      if (stated && (size_t)st.st_size == total) {
        void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED)
          return Status::Error(UNISON_ERR_INTERNAL, "unison: cannot map shared memory: " + errno_text());
        base_ = static_cast<char*>(p);
        mapped_bytes_ = total;
        header_ = reinterpret_cast<Header*>(base_);
        unlinked_ = true;  // not ours to remove
        return Status::OK();
      }
      close(fd);  // created but not yet sized: try again
    }
    if (monotonic_seconds() > deadline)
      return Status::Error(UNISON_ERR_INTERNAL, "unison: local rank 0 did not create shared memory " + name_ +
                                                    " in time (see UNISON_START_TIMEOUT)");
    if (Status watched = pause_watching(); !watched.ok()) return watched;
  }
}

Status ShmSegment::wait_for_everyone(const Config& config, double deadline) {
  RankArea* me = rank_area(config.local_rank);
  me->pid.store((int32_t)getpid());
  me->heartbeat_ns.store(monotonic_nanoseconds());
  me->attached.store(1, std::memory_order_release);
  for (;;) {
    std::string missing;
    for (int r = 0; r < config.local_size; ++r)
      if (rank_area(r)->attached.load(std::memory_order_acquire) == 0)
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    if (missing.empty()) break;
    if (monotonic_seconds() > deadline)
      return Status::Error(UNISON_ERR_RANK_FAILED, "unison: local ranks [" + missing +
                                                       "] did not start within " +
                                                       std::to_string((int)config.start_timeout_seconds) +
                                                       " s (see UNISON_START_TIMEOUT)");
    if (Status watched = pause_watching(); !watched.ok()) return watched;
  }
  // Nobody returns from init while the name still exists, so a job that is
  // running never has anything in /dev/shm to leak.
  if (config.local_rank == 0) {
    shm_unlink(name_.c_str());
    header_->name_removed.store(1, std::memory_order_release);
  }
  while (header_->name_removed.load(std::memory_order_acquire) == 0) {
    if (monotonic_seconds() > deadline)
      return Status::Error(UNISON_ERR_RANK_FAILED, "unison: local rank 0 stopped during start-up");
    if (Status watched = pause_watching(); !watched.ok()) return watched;
  }
  unlinked_ = true;
  return Status::OK();
}

}  // namespace unison
