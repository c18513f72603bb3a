#include "cycle_requests.h"


namespace unison {
namespace {
// Collectives never match point-to-point messages, so one tag on the
// communicator the collectives use is enough.
constexpr int kTag = 7;
}  // namespace

CycleRequests::CycleRequests(MPI_Comm comm) : comm_(comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  for (int r = 0; r < size; ++r)
    if (r != rank) peers_.push_back(r);
  post_receive();
}

CycleRequests::~CycleRequests() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (!peers_.empty()) {
    MPI_Cancel(&receive_);
    MPI_Wait(&receive_, MPI_STATUS_IGNORE);
  }
  // One-word sends complete eagerly; the ones still listed are released
  // to finish on their own.
  for (Sent& s : sent_) MPI_Request_free(&s.request);
}

void CycleRequests::post_receive() {
  if (peers_.empty()) return;
  MPI_Irecv(&incoming_, 1, MPI_UINT64_T, MPI_ANY_SOURCE, kTag, comm_, &receive_);
}

void CycleRequests::announce(uint64_t count) {
  if (count <= announced_) return;
  announced_ = count;
  while (!sent_.empty()) {  // forget the sends that are done
    int done = 0;
    MPI_Test(&sent_.front().request, &done, MPI_STATUS_IGNORE);
    if (!done) break;
    sent_.pop_front();
  }
  for (int peer : peers_) {
    sent_.push_back(Sent{count, MPI_REQUEST_NULL});
    MPI_Isend(&sent_.back().count, 1, MPI_UINT64_T, peer, kTag, comm_, &sent_.back().request);
  }
}

uint64_t CycleRequests::heard() {
  if (peers_.empty()) return heard_;
  for (;;) {
    int done = 0;
    MPI_Test(&receive_, &done, MPI_STATUS_IGNORE);
    if (!done) return heard_;
      if (incoming_ > heard_) heard_ = incoming_;
    post_receive();
  }
}

}  // namespace unison
