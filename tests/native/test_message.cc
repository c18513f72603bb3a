// The negotiation messages' wire form (native/message.cc): what is encoded
// decodes to the same message; a message cut short anywhere, or with a
// count that claims more than it holds, is refused as corrupt, never read
// past or allocated for; and the size helpers saturate instead of wrapping.
#define UNIT_FILE "message"
#include <cstdint>
#include <string>

#include "message.h"
#include "unit.h"
#include "unison.h"

using unison::CycleMessage;
using unison::Request;
using unison::Response;
using unison::ResponseList;

namespace {

CycleMessage a_cycle_message() {
  CycleMessage m;
  m.flags = CycleMessage::kMoreQueued | CycleMessage::kTuning;
  m.ready_bits = {1, 0xffffffffffffffffull};
  m.invalid_bits = {4};
  m.busy_sets = {3, 7};
  for (int i = 0; i < 3; ++i) {
    Request r;
    r.rank = 2;
    r.op = UNISON_ALLTOALL;
    r.name = "grad." + std::to_string(i) + std::string(i * 50, 'x');
    r.dtype = UNISON_FLOAT32;
    r.shape = {4, i, 3};
    r.reduce_op = UNISON_SUM;
    r.prescale = 0.5;
    r.postscale = -2.0;
    r.root = i;
    r.splits = {1, 3};
    r.device = i - 1;
    r.placeholder = i == 1;
    m.requests.push_back(r);
  }
  m.tuned_fusion_threshold = 1 << 20;
  m.tuned_cycle_time_ms = 2.5;
  m.tuned_settled = 1;
  return m;
}

ResponseList a_response_list() {
  ResponseList list;
  list.more_ready = true;
  Response r;
  r.op = UNISON_ALLGATHER;
  r.dtype = UNISON_INT64;
  r.error = "";
  r.tensors.push_back({"a", {2, 3}, {2, 5}, {}});
  r.tensors.push_back({"b", {}, {}, {1, 1, 1, 1}});
  list.responses.push_back(r);
  list.responses.push_back(unison::error_response("c", UNISON_ERR_MISMATCH, "ranks disagree"));
  return list;
}

}  // namespace

UNIT_TEST(a_cycle_message_decodes_to_what_was_encoded) {
  const CycleMessage m = a_cycle_message();
  CycleMessage back;
  EXPECT(unison::decode(unison::encode(m), &back).ok());
  EXPECT_EQ(back.flags, m.flags);
  EXPECT(back.ready_bits == m.ready_bits && back.invalid_bits == m.invalid_bits && back.busy_sets == m.busy_sets);
  EXPECT_EQ(back.requests.size(), m.requests.size());
  for (size_t i = 0; i < m.requests.size() && i < back.requests.size(); ++i) {
    const Request &a = m.requests[i], &b = back.requests[i];
    EXPECT(a.rank == b.rank && a.op == b.op && a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
           a.reduce_op == b.reduce_op && a.prescale == b.prescale && a.postscale == b.postscale &&
           a.root == b.root && a.splits == b.splits && a.device == b.device && a.placeholder == b.placeholder);
    EXPECT_EQ(unison::encoded_size(a), unison::encoded_size(b));
  }
  EXPECT(back.tuned_fusion_threshold == m.tuned_fusion_threshold && back.tuned_cycle_time_ms == 2.5 &&
         back.tuned_settled == 1);
}

UNIT_TEST(a_response_list_decodes_to_what_was_encoded) {
  const ResponseList list = a_response_list();
  ResponseList back;
  EXPECT(unison::decode(unison::encode(list), &back).ok());
  EXPECT(back.more_ready);
  EXPECT_EQ(back.responses.size(), (size_t)2);
  if (back.responses.size() == 2) {
    EXPECT_EQ(back.responses[0].tensors.size(), (size_t)2);
    EXPECT(back.responses[0].tensors[0].first_dims == (std::vector<int64_t>{2, 5}));
    EXPECT(back.responses[0].tensors[1].splits == (std::vector<int64_t>{1, 1, 1, 1}));
    EXPECT(back.responses[1].is_error() && back.responses[1].error == "ranks disagree");
    EXPECT_EQ(back.responses[1].tensors[0].name, std::string("c"));
  }
}

UNIT_TEST(a_message_cut_short_anywhere_is_refused_as_corrupt) {
  const std::string cycle = unison::encode(a_cycle_message());
  for (size_t n = 0; n < cycle.size(); ++n) {
    CycleMessage back;
    EXPECT(!unison::decode(cycle.substr(0, n), &back).ok());
  }
  const std::string responses = unison::encode(a_response_list());
  for (size_t n = 0; n < responses.size(); ++n) {
    ResponseList back;
    EXPECT(!unison::decode(responses.substr(0, n), &back).ok());
  }
}

UNIT_TEST(a_count_larger_than_the_message_is_refused_before_anything_is_allocated) {
  // Every 4-byte field of a short message set to 0xffffffff in turn: each
  // count, length or vector size then claims billions of entries.
  const std::string cycle = unison::encode(a_cycle_message());
  for (size_t at = 0; at + 4 <= cycle.size(); ++at) {
    std::string bad = cycle;
    bad.replace(at, 4, "\xff\xff\xff\xff", 4);
    CycleMessage back;
    (void)unison::decode(bad, &back);  // refused, or read as other values: never a crash or bad_alloc
    EXPECT(back.requests.size() <= cycle.size());
  }
  const std::string responses = unison::encode(a_response_list());
  for (size_t at = 0; at + 4 <= responses.size(); ++at) {
    std::string bad = responses;
    bad.replace(at, 4, "\xff\xff\xff\xff", 4);
    ResponseList back;
    (void)unison::decode(bad, &back);
    EXPECT(back.responses.size() <= responses.size());
  }
}

UNIT_TEST(sizes_saturate_instead_of_wrapping) {
  EXPECT_EQ(unison::element_count({}), (int64_t)1);
  EXPECT_EQ(unison::element_count({3, 0, INT64_MAX}), (int64_t)0);
  EXPECT_EQ(unison::element_count({1 << 30, 1 << 30, 1 << 30}), INT64_MAX);
  EXPECT_EQ(unison::row_bytes({5, 2, 3}, UNISON_FLOAT64), (size_t)48);
  EXPECT_EQ(unison::row_bytes({5}, UNISON_FLOAT64), (size_t)8);
  EXPECT_EQ(unison::row_bytes({1, INT64_MAX / 2, 4}, UNISON_FLOAT64), SIZE_MAX);
  EXPECT_EQ(unison::row_bytes({1, INT64_MAX / 16}, UNISON_FLOAT64), (size_t)(INT64_MAX / 16) * 8);  // fits
  EXPECT_EQ(unison::row_bytes({1, INT64_MAX / 2}, UNISON_FLOAT64), SIZE_MAX);  // the bytes would not
  EXPECT_EQ(unison::row_bytes({1, -1}, UNISON_FLOAT64), SIZE_MAX);
  EXPECT_EQ(unison::row_bytes({9, 0, INT64_MAX}, UNISON_FLOAT64), (size_t)0);
}
