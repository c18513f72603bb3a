// message.h: what ranks tell each other during negotiation, and its wire
// form. Messages are small and built once per cycle, so the encoding is a
// plain length-prefixed byte string that any backend can carry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace unison {

// One rank's request to run one named collective.
struct Request {
  int rank = 0;
  int op = 0;
  std::string name;
  int dtype = 0;
  std::vector<int64_t> shape;
  int reduce_op = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  int root = 0;
  // alltoall: rows to each rank (size entries); add_process_set: the new
  // set's global ranks. remove_process_set carries the set's id as root.
  std::vector<int64_t> splits;
  int device = -1;
  bool placeholder = false;  // allreduce, reducescatter: zeros for a tensor this rank does not have
};

// One tensor of an agreed response, with what each rank contributes.
struct TensorPlan {
  std::string name;
  std::vector<int64_t> shape;       // the common shape (first dim of rank 0 for allgather)
  std::vector<int64_t> first_dims;  // allgather and alltoall: rows from each rank
  std::vector<int64_t> splits;      // alltoall: size*size rows, [sender][receiver]
};

// The coordinator's decision: run these tensors (fused when several), or
// fail them with `error`.
struct Response {
  int op = 0;
  int dtype = 0;
  int reduce_op = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  int root = 0;
  int device = -1;
  int error_code = 0;        // non-zero: an error response
  std::string error;
  int last_joined_rank = -1;  // join
  bool cacheable = true;
  bool unused_everywhere = false;  // allreduce, reducescatter: every contribution was a placeholder
  std::vector<TensorPlan> tensors;

  bool is_error() const { return error_code != 0; }
};

// A response that fails one tensor on every rank that submitted it.
Response error_response(const std::string& name, int code, const std::string& message);

// What every rank contributes to a cycle.
struct CycleMessage {
  enum Flags : uint32_t {
    kJoined = 1,        // this rank has called join and waits in it
    kShutdown = 2,      // this rank is shutting down
    kMoreQueued = 4,    // requests did not all fit; another cycle is needed
    kTuning = 8,        // rank 0 only: every rank switches to `tuning` now
    kBlocked = 16,      // every thread that submits here is blocked waiting (caller_activity.h)
  };
  uint32_t flags = 0;
  std::vector<uint64_t> ready_bits;    // cache positions whose tensor is ready here
  std::vector<uint64_t> invalid_bits;  // cache positions whose parameters changed here
  std::vector<Request> requests;       // requests the cache could not express
  // Global set only: the other process sets that have work on this rank.
  // Their members run a cycle of each such set right after this one.
  std::vector<int32_t> busy_sets;
  // With kTuning: the autotuner's setting (autotune.h), as plain fields.
  uint64_t tuned_fusion_threshold = 0;
  double tuned_cycle_time_ms = 0;
  uint8_t tuned_cache = 1, tuned_hierarchical = 1, tuned_settled = 0;
};

// The coordinator's answer to a cycle.
struct ResponseList {
  bool more_ready = false;  // responses were held back; run another cycle
  std::vector<Response> responses;
};

std::string encode(const CycleMessage& m);
Status decode(const std::string& bytes, CycleMessage* m);
std::string encode(const ResponseList& m);
Status decode(const std::string& bytes, ResponseList* m);
// Bytes a request adds to an encoded CycleMessage, for message budgeting.
size_t encoded_size(const Request& r);
size_t encoded_size(const Response& r);

// "[2, 3]"
std::string shape_string(const std::vector<int64_t>& shape);
int64_t element_count(const std::vector<int64_t>& shape);
// Bytes of one row (everything but the first dimension).
size_t row_bytes(const std::vector<int64_t>& shape, int dtype);

}  // namespace unison
