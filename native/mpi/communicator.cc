#include "communicator.h"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>

#include "../byte_stream.h"
#include "../copy.h"
#include "../dtype.h"
#include "../futex.h"
#include "../reduce.h"
#include "../timeline.h"
#include "world.h"

namespace unison {
namespace {

// How often a waiting rank looks at the peers it can see.
constexpr double kLivenessInterval = 0.05;
// A data wait may last the peer timeout plus the time its bytes take at
// this rate, the slowest network a job is expected to run on.
constexpr double kSlowestBytesPerSecond = 50e6;
// Allreduces larger than this go in windows, which bounds the scratch
// memory and keeps every MPI count far from INT_MAX.
constexpr size_t kAllreduceWindowBytes = 64u << 20;
// An idle wait yields its core between tests this long before it starts
// sleeping: long enough for a peer that is merely late in the same cycle.
constexpr double kYieldSeconds = 1e-3;
// How long an idle wait sleeps between tests, at most.
constexpr double kLongestPause = 1e-3;

size_t round_down(size_t n, size_t to) { return n / to * to; }

// Bytes of each rank's part, summed over the tensors of a fused allgather or
// reducescatter: what each rank contributes in the first, what each rank is
// sent in the second.
template <typename Tensors>
std::vector<size_t> bytes_by_rank(const Tensors& tensors, int size) {
  std::vector<size_t> total(size, 0);
  for (const auto& t : tensors)
    for (int r = 0; r < size; ++r) total[r] += t.bytes_per_rank[r];
  return total;
}

// MPI counts and displacements are ints. Parts of 2 GiB or more are refused
// with an error that says so, never truncated.
Status to_counts(const std::vector<size_t>& bytes, std::vector<int>* counts, std::vector<int>* offsets,
                 const char* what) {
  counts->clear();
  offsets->clear();
  size_t at = 0;
  for (size_t b : bytes) {
    if (at + b > (size_t)INT_MAX)
      return Status::Error(UNISON_ERR_UNSUPPORTED, std::string("unison: ") + what + " of " +
                                                       std::to_string(at + b) +
                                                       " bytes per rank or more over MPI; MPI counts stop at 2 GiB, "
                                                       "so split the tensor");
    counts->push_back((int)b);
    offsets->push_back((int)at);
    at += b;
  }
  return Status::OK();
}

}  // namespace

Status mpi_wait(MPI_Request* request, const std::string& what, double limit_seconds, const Liveness& liveness,
                double spin_seconds, bool idle) {
  const double start = monotonic_seconds();
  double next_look = start + kLivenessInterval;
  double pause = 20e-6;
  for (;;) {
    int done = 0;
    const int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_error(what, rc);
    if (done) return Status::OK();
    const double now = monotonic_seconds();
    if (now >= next_look) {
      next_look = now + kLivenessInterval;
      if (liveness) {
        Status s = liveness();
        if (!s.ok()) return s;
      }
      if (now - start > limit_seconds)
        return Status::Error(UNISON_ERR_RANK_FAILED,
                             "unison: " + what + " got no answer from some rank within " +
                                 std::to_string((int)limit_seconds) +
                                 " s: it has died on another host, or stopped (UNISON_PEER_TIMEOUT_SECONDS)");
    }
    if (now - start < spin_seconds) {
      cpu_relax();
    } else if (!idle || now - start < kYieldSeconds) {
      sched_yield();  // let a peer on this core make its progress
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(pause));
      pause = std::min(pause * 2, kLongestPause);
    }
  }
}

Status MpiCommunicator::create(MPI_Comm parent, const Config& config, Liveness liveness,
                               std::unique_ptr<MpiCommunicator>* out) {
  MPI_Comm comm;
  MPI_Request request;
  int rc = MPI_Comm_idup(parent, &comm, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Comm_idup", rc);
  Status s = mpi_wait(&request, "MPI_Comm_idup", config.start_timeout_seconds, liveness,
                      config.spin_microseconds * 1e-6, true);
  if (!s.ok()) return s;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  out->reset(new MpiCommunicator(comm, config, std::move(liveness)));
  return Status::OK();
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, const Config& config, Liveness liveness)
    : comm_(comm), config_(config), liveness_(std::move(liveness)) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

Status MpiCommunicator::wait(MPI_Request* request, const char* what, size_t bytes) {
  if (!broken_.ok()) return broken_;
  const double limit = config_.peer_timeout_seconds + (double)bytes / kSlowestBytesPerSecond;
  return remember(mpi_wait(request, what, limit, liveness_, config_.spin_microseconds * 1e-6, false));
}

Status MpiCommunicator::wait_idle(MPI_Request* request, const char* what) {
  if (!broken_.ok()) return broken_;
  return remember(mpi_wait(request, what, config_.peer_timeout_seconds, liveness_, config_.spin_microseconds * 1e-6, true));
}

// A collective left half done cannot be resumed: the communicator is
// broken for good, and MPI must not be finalized at exit (world.cc).
Status MpiCommunicator::remember(const Status& s) {
  if (!s.ok()) {
    broken_ = s;
    mark_mpi_broken();
  }
  return s;
}

// ---- control plane -----------------------------------------------------------------

Status MpiCommunicator::allgather_strings(const std::string& mine, std::vector<std::string>* everyone) {
  std::vector<int64_t> lengths(size_);
  int64_t my_length = (int64_t)mine.size();
  MPI_Request request;
  int rc = MPI_Iallgather(&my_length, 1, MPI_INT64_T, lengths.data(), 1, MPI_INT64_T, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgather", rc);
  Status s = wait_idle(&request, "the control-plane exchange");
  if (!s.ok()) return s;
  std::vector<int> counts, offsets;
  s = to_counts(std::vector<size_t>(lengths.begin(), lengths.end()), &counts, &offsets, "a control message");
  if (!s.ok()) return s;
  receive_.resize((size_t)offsets.back() + counts.back() + 1);
  rc = MPI_Iallgatherv(mine.data(), (int)mine.size(), MPI_BYTE, receive_.data(), counts.data(), offsets.data(),
                       MPI_BYTE, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgatherv", rc);
  s = wait_idle(&request, "the control-plane exchange");
  if (!s.ok()) return s;
  everyone->resize(size_);
  for (int r = 0; r < size_; ++r) (*everyone)[r].assign(receive_.data() + offsets[r], counts[r]);
  return Status::OK();
}

Status MpiCommunicator::broadcast_string(std::string* message, int root) {
  int64_t length = (int64_t)message->size();
  MPI_Request request;
  int rc = MPI_Ibcast(&length, 1, MPI_INT64_T, root, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Ibcast", rc);
  Status s = wait_idle(&request, "the control-plane broadcast");
  if (!s.ok()) return s;
  if (length > INT_MAX)
    return Status::Error(UNISON_ERR_INTERNAL, "unison: a control message of " + std::to_string(length) + " bytes");
  message->resize((size_t)length);
  rc = MPI_Ibcast(&(*message)[0], (int)length, MPI_BYTE, root, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Ibcast", rc);
  return wait_idle(&request, "the control-plane broadcast");
}

// ---- data plane ----------------------------------------------------------------------
//
// How many times each byte moves in an allreduce of S bytes on N ranks:
// the input is packed into the fusion buffer once (one copy); MPI sends
// (N-1)/N of it to the chunks' owners; each owner reduces its chunk in
// place; MPI sends the (N-1)/N of the result that others reduced back;
// the result is unpacked into the outputs once (one copy). Each rank sends
// and receives 2(N-1)/N * S bytes, the least any allreduce can.

Status MpiCommunicator::allreduce(const AllreduceOptions& o) {
  ByteStream in, out;
  for (const Segment& segment : o.segments) {
    in.append(segment.input, segment.bytes);
    out.append(segment.output, segment.bytes);
  }
  const size_t element = dtype_size(o.reduce.dtype);
  const size_t window = std::max(round_down(kAllreduceWindowBytes, element * size_), element * size_);
  for (size_t lo = 0; lo < in.size(); lo += window) {
    const size_t hi = std::min(in.size(), lo + window);
    send_.resize(hi - lo);
    {
      TimelinePhase phase("PACK");
      in.read(lo, hi, send_.data());
    }
    Status s = allreduce_window(o.reduce, hi - lo);
    if (!s.ok()) return s;
    TimelinePhase phase("UNPACK");
    out.write(lo, hi, send_.data());
  }
  return Status::OK();
}

// Reduces the first `bytes` of send_ in place.
Status MpiCommunicator::allreduce_window(const ReduceSpec& spec, size_t bytes) {
  const size_t element = dtype_size(spec.dtype);
  std::vector<const void*> inputs(size_);
  MPI_Request request;
  if (bytes <= config_.small_allreduce_bytes) {
    // Small: everyone gets everything and reduces all of it, one round.
    receive_.resize(bytes * size_);
    Status s;
    {
      TimelinePhase phase("MPI_IALLGATHER");
      int rc = MPI_Iallgather(send_.data(), (int)bytes, MPI_BYTE, receive_.data(), (int)bytes, MPI_BYTE, comm_, &request);
      if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgather", rc);
      s = wait(&request, "allreduce", bytes * size_);
    }
    if (!s.ok()) return s;
    TimelinePhase phase("REDUCE");
    for (int r = 0; r < size_; ++r) inputs[r] = receive_.data() + r * bytes;
    reduce(spec, inputs.data(), size_, send_.data(), bytes / element);
    return Status::OK();
  }
  // Large: rank r owns chunk r. Everyone sends each owner its chunk, the
  // owner reduces, and the owners' results are gathered by everyone.
  const size_t count = bytes / element;
  std::vector<size_t> chunk(size_);
  for (int r = 0; r < size_; ++r) chunk[r] = (count * (r + 1) / size_ - count * r / size_) * element;
  std::vector<int> send_counts, send_offsets;
  Status s = to_counts(chunk, &send_counts, &send_offsets, "allreduce");
  if (!s.ok()) return s;
  const size_t mine = chunk[rank_];
  std::vector<int> receive_counts(size_, (int)mine), receive_offsets(size_);
  for (int r = 0; r < size_; ++r) receive_offsets[r] = (int)(r * mine);
  // This rank's own chunk stays where it is.
  send_counts[rank_] = receive_counts[rank_] = 0;
  receive_.resize(mine * size_);
  {
    TimelinePhase phase("MPI_IALLTOALLV");
    int rc = MPI_Ialltoallv(send_.data(), send_counts.data(), send_offsets.data(), MPI_BYTE, receive_.data(),
                            receive_counts.data(), receive_offsets.data(), MPI_BYTE, comm_, &request);
    if (rc != MPI_SUCCESS) return mpi_error("MPI_Ialltoallv", rc);
    s = wait(&request, "allreduce", bytes);
  }
  if (!s.ok()) return s;
  char* my_chunk = send_.data() + send_offsets[rank_];
  {
    TimelinePhase phase("REDUCE");
    for (int r = 0; r < size_; ++r) inputs[r] = r == rank_ ? my_chunk : receive_.data() + r * mine;
    reduce(spec, inputs.data(), size_, my_chunk, mine / element);
  }
  TimelinePhase phase("MPI_IALLGATHERV");
  send_counts[rank_] = (int)mine;
  int rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, send_.data(), send_counts.data(), send_offsets.data(), MPI_BYTE,
                       comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgatherv", rc);
  return wait(&request, "allreduce", bytes);
}

Status MpiCommunicator::allgather(const AllgatherOptions& o) {
  // Rank r's stream: its part of each tensor in turn.
  const std::vector<size_t> stream = bytes_by_rank(o.tensors, size_);
  std::vector<int> counts, offsets;
  Status s = to_counts(stream, &counts, &offsets, "allgather");
  if (!s.ok()) return s;
  const size_t total = (size_t)offsets.back() + counts.back();
  MPI_Request request;
  if (o.tensors.size() == 1) {  // the output is already in rank order: no packing
    const auto& t = o.tensors[0];
    // MPI refuses an input that overlaps the output unless told it is in place.
    const bool in_place = t.input == static_cast<char*>(t.output) + offsets[rank_];
    int rc = MPI_Iallgatherv(in_place ? MPI_IN_PLACE : t.input, counts[rank_], MPI_BYTE, t.output, counts.data(),
                             offsets.data(), MPI_BYTE, comm_, &request);
    if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgatherv", rc);
    return wait(&request, "allgather", total);
  }
  send_.resize(stream[rank_] + 1);
  size_t at = 0;
  for (const auto& t : o.tensors) {
    if (t.bytes_per_rank[rank_] > 0) copy_bytes(send_.data() + at, t.input, t.bytes_per_rank[rank_]);
    at += t.bytes_per_rank[rank_];
  }
  receive_.resize(total + 1);
  int rc = MPI_Iallgatherv(send_.data(), counts[rank_], MPI_BYTE, receive_.data(), counts.data(), offsets.data(),
                           MPI_BYTE, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Iallgatherv", rc);
  s = wait(&request, "allgather", total);
  if (!s.ok()) return s;
  std::vector<size_t> read(offsets.begin(), offsets.end());
  for (const auto& t : o.tensors) {
    size_t written = 0;
    for (int r = 0; r < size_; ++r) {
      const size_t n = t.bytes_per_rank[r];
      if (n > 0) copy_bytes(static_cast<char*>(t.output) + written, receive_.data() + read[r], n);
      read[r] += n;
      written += n;
    }
  }
  return Status::OK();
}

Status MpiCommunicator::broadcast(void* buffer, size_t bytes, int root) {
  constexpr size_t kPiece = 1u << 30;
  for (size_t lo = 0; lo < bytes; lo += kPiece) {
    const size_t n = std::min(kPiece, bytes - lo);
    MPI_Request request;
    int rc = MPI_Ibcast(static_cast<char*>(buffer) + lo, (int)n, MPI_BYTE, root, comm_, &request);
    if (rc != MPI_SUCCESS) return mpi_error("MPI_Ibcast", rc);
    Status s = wait(&request, "broadcast", n);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status MpiCommunicator::alltoall(const AlltoallOptions& o) {
  std::vector<size_t> sends(size_), receives(size_);
  for (int r = 0; r < size_; ++r) {
    sends[r] = o.bytes[(size_t)rank_ * size_ + r];
    receives[r] = o.bytes[(size_t)r * size_ + rank_];
  }
  std::vector<int> send_counts, send_offsets, receive_counts, receive_offsets;
  Status s = to_counts(sends, &send_counts, &send_offsets, "alltoall");
  if (s.ok()) s = to_counts(receives, &receive_counts, &receive_offsets, "alltoall");
  if (!s.ok()) return s;
  MPI_Request request;
  int rc = MPI_Ialltoallv(o.input, send_counts.data(), send_offsets.data(), MPI_BYTE, o.output, receive_counts.data(),
                          receive_offsets.data(), MPI_BYTE, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Ialltoallv", rc);
  return wait(&request, "alltoall", (size_t)send_offsets.back() + send_counts.back());
}

Status MpiCommunicator::reducescatter(const ReducescatterOptions& o) {
  // Each rank sends rank r the r-th part of every tensor, in one block, and
  // receives its own part of every tensor from every rank.
  const std::vector<size_t> to_rank = bytes_by_rank(o.tensors, size_);
  std::vector<int> send_counts, send_offsets;
  Status s = to_counts(to_rank, &send_counts, &send_offsets, "reducescatter");
  if (!s.ok()) return s;
  const size_t mine = to_rank[rank_];
  if ((size_t)size_ * mine > (size_t)INT_MAX)
    return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: reducescatter of 2 GiB or more per rank over MPI");
  send_.resize((size_t)send_offsets.back() + send_counts.back() + 1);
  std::vector<size_t> write(send_offsets.begin(), send_offsets.end());
  for (const auto& t : o.tensors) {
    size_t read = 0;
    for (int r = 0; r < size_; ++r) {
      const size_t n = t.bytes_per_rank[r];
      if (n > 0) copy_bytes(send_.data() + write[r], static_cast<const char*>(t.input) + read, n);
      write[r] += n;
      read += n;
    }
  }
  receive_.resize(mine * size_ + 1);
  std::vector<int> receive_counts(size_, (int)mine), receive_offsets(size_);
  for (int r = 0; r < size_; ++r) receive_offsets[r] = (int)(r * mine);
  MPI_Request request;
  int rc = MPI_Ialltoallv(send_.data(), send_counts.data(), send_offsets.data(), MPI_BYTE, receive_.data(),
                          receive_counts.data(), receive_offsets.data(), MPI_BYTE, comm_, &request);
  if (rc != MPI_SUCCESS) return mpi_error("MPI_Ialltoallv", rc);
  s = wait(&request, "reducescatter", send_.size());
  if (!s.ok()) return s;
  const size_t element = dtype_size(o.reduce.dtype);
  std::vector<const void*> inputs(size_);
  size_t at = 0;
  for (const auto& t : o.tensors) {
    const size_t n = t.bytes_per_rank[rank_];
    for (int r = 0; r < size_; ++r) inputs[r] = receive_.data() + r * mine + at;
    reduce(o.reduce, inputs.data(), size_, t.output, n / element);
    at += n;
  }
  return Status::OK();
}

}  // namespace unison
