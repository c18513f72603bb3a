// Rank 0's coordinator (native/coordinator.cc) in-process: requests that
// agree become one response, requests that differ an error naming every
// rank's value, and requests no rank's own checks could have sent (a
// corrupt message) are refused before any table is indexed by them.
#define UNIT_FILE "coordinator"
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator.h"
#include "unit.h"
#include "unison.h"

using unison::Coordinator;
using unison::Request;
using unison::Response;

namespace {

Request request(int rank, int op, const std::string& name, std::vector<int64_t> shape,
                std::vector<int64_t> splits = {}) {
  Request r;
  r.rank = rank;
  r.op = op;
  r.name = name;
  r.dtype = UNISON_FLOAT32;
  r.shape = std::move(shape);
  r.splits = std::move(splits);
  return r;
}

std::vector<Response> decide(int size, const std::vector<Request>& requests) {
  Coordinator c(size);
  for (const Request& r : requests) c.add(r, 0.0);
  bool more = false;
  return c.take_ready(1 << 20, &more);
}

}  // namespace

UNIT_TEST(agreeing_requests_become_one_response) {
  const auto out = decide(3, {request(0, UNISON_ALLGATHER, "g", {2, 4}), request(1, UNISON_ALLGATHER, "g", {0, 4}),
                              request(2, UNISON_ALLGATHER, "g", {5, 4})});
  EXPECT_EQ(out.size(), (size_t)1);
  if (out.size() == 1) {
    EXPECT(!out[0].is_error());
    EXPECT(out[0].tensors[0].first_dims == (std::vector<int64_t>{2, 0, 5}));
  }
}

UNIT_TEST(disagreeing_requests_become_an_error_naming_each_rank) {
  const auto out = decide(2, {request(0, UNISON_ALLREDUCE, "w", {3}), request(1, UNISON_ALLREDUCE, "w", {4})});
  EXPECT_EQ(out.size(), (size_t)1);
  if (out.size() == 1) {
    EXPECT_EQ(out[0].error_code, (int)UNISON_ERR_MISMATCH);
    EXPECT_EQ(out[0].error, std::string("unison: allreduce 'w': ranks disagree on shape: rank 0 [3], rank 1 [4]"));
  }
}

UNIT_TEST(an_allgather_whose_total_wraps_is_refused_naming_the_tensor) {
  const int64_t huge = INT64_MAX / 8;
  // 2^60 rows of 16 bytes from each rank: 2^65 bytes to receive.
  const auto out = decide(2, {request(0, UNISON_ALLGATHER, "big", {huge, 4}),
                              request(1, UNISON_ALLGATHER, "big", {huge, 4})});
  EXPECT_EQ(out.size(), (size_t)1);
  if (out.size() == 1) {
    EXPECT_EQ(out[0].error_code, (int)UNISON_ERR_INVALID_ARGUMENT);
    EXPECT(out[0].error.find("allgather 'big': what a rank would receive is more bytes than memory can address") !=
           std::string::npos);
  }
}

UNIT_TEST(an_alltoall_whose_receipts_wrap_is_refused) {
  const int64_t huge = INT64_MAX / 8;
  const auto out = decide(2, {request(0, UNISON_ALLTOALL, "a", {huge + 1, 4}, {huge, 1}),
                              request(1, UNISON_ALLTOALL, "a", {huge + 1, 4}, {huge, 1})});
  EXPECT_EQ(out.size(), (size_t)1);
  if (out.size() == 1) EXPECT_EQ(out[0].error_code, (int)UNISON_ERR_INVALID_ARGUMENT);
}

UNIT_TEST(requests_no_rank_could_send_are_not_well_formed) {
  EXPECT(unison::well_formed(request(0, UNISON_ALLTOALL, "a", {4}, {2, 2}), 2).ok());
  EXPECT(unison::well_formed(request(0, UNISON_REDUCESCATTER, "r", {4}), 2).ok());
  EXPECT(unison::well_formed(request(0, UNISON_BARRIER, "b", {}), 2).ok());
  // Splits of the wrong count (the coordinator copies size of them per
  // rank), ones that wrap to the row count, negative ones.
  EXPECT(!unison::well_formed(request(0, UNISON_ALLTOALL, "a", {4}, {1, 1, 2}), 2).ok());
  EXPECT(!unison::well_formed(request(0, UNISON_ALLTOALL, "a", {4}, {INT64_MAX, INT64_MAX, 6}), 3).ok());
  EXPECT(!unison::well_formed(request(0, UNISON_ALLTOALL, "a", {0}, {-1, 1}), 2).ok());
  EXPECT(!unison::well_formed(request(0, UNISON_REDUCESCATTER, "r", {4}, {5, -1}), 2).ok());
  EXPECT(!unison::well_formed(request(0, UNISON_ALLREDUCE, "n", {-3}), 2).ok());
  Request bad_op = request(0, 77, "x", {1});
  EXPECT(!unison::well_formed(bad_op, 2).ok());
  Request bad_dtype = request(0, UNISON_ALLREDUCE, "x", {1});
  bad_dtype.dtype = 99;
  EXPECT(!unison::well_formed(bad_dtype, 2).ok());
  Request bad_root = request(0, UNISON_BROADCAST, "x", {1});
  bad_root.root = 2;
  EXPECT(!unison::well_formed(bad_root, 2).ok());
}
