// The response cache (native/response_cache.cc): a request agrees by one
// bit only when it is exactly what its rank would send for the remembered
// response; anything else about it changed makes the entry stale, to be
// negotiated afresh. The least recently used entry goes first.
#define UNIT_FILE "response_cache"
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "coordinator.h"
#include "response_cache.h"
#include "unit.h"
#include "unison.h"

using unison::Request;
using unison::Response;
using unison::ResponseCache;

namespace {

Request request(const std::string& name, int op = UNISON_ALLREDUCE, std::vector<int64_t> shape = {4, 2}) {
  Request r;
  r.name = name;
  r.op = op;
  r.dtype = UNISON_FLOAT32;
  r.shape = std::move(shape);
  r.reduce_op = UNISON_SUM;
  return r;
}

// What the coordinator decides for `r` on a job of `size` where every rank
// sent the same.
Response response_to(const Request& r, int size) {
  unison::Coordinator coordinator(size);
  for (int rank = 0; rank < size; ++rank) {
    Request from = r;
    from.rank = rank;
    coordinator.add(from, 0.0);
  }
  bool more = false;
  return coordinator.take_ready(1 << 20, &more).at(0);
}

ResponseCache::Lookup look(const ResponseCache& cache, const Request& r, int size = 2) {
  int position = -1;
  return cache.lookup(r, size, &position);
}

}  // namespace

UNIT_TEST(an_exact_repeat_hits_and_any_change_is_stale) {
  ResponseCache cache(8);
  const Request r = request("w");
  EXPECT(look(cache, r) == ResponseCache::Lookup::kMiss);
  cache.put(response_to(r, 2));
  EXPECT(look(cache, r) == ResponseCache::Lookup::kHit);
  Request changed = r;
  changed.shape = {4, 3};
  EXPECT(look(cache, changed) == ResponseCache::Lookup::kStale);
  changed = r;
  changed.dtype = UNISON_FLOAT64;
  EXPECT(look(cache, changed) == ResponseCache::Lookup::kStale);
  changed = r;
  changed.reduce_op = UNISON_MAX;
  EXPECT(look(cache, changed) == ResponseCache::Lookup::kStale);
  changed = r;
  changed.prescale = 0.5;
  EXPECT(look(cache, changed) == ResponseCache::Lookup::kStale);
  changed = r;
  changed.placeholder = true;  // negotiated in full, whatever the cache holds
  EXPECT(look(cache, changed) == ResponseCache::Lookup::kStale);
}

UNIT_TEST(an_allgather_hits_only_with_the_rows_its_rank_sent) {
  ResponseCache cache(8);
  Request r = request("g", UNISON_ALLGATHER, {3, 5});
  r.rank = 1;
  cache.put(response_to(r, 3));
  EXPECT(look(cache, r, 3) == ResponseCache::Lookup::kHit);
  Request more_rows = r;
  more_rows.shape = {4, 5};
  EXPECT(look(cache, more_rows, 3) == ResponseCache::Lookup::kStale);
  EXPECT(look(cache, r, 4) == ResponseCache::Lookup::kStale);  // another job size
}

UNIT_TEST(the_least_recently_used_entry_goes_first) {
  ResponseCache cache(2);
  cache.put(response_to(request("a"), 2));
  cache.put(response_to(request("b"), 2));
  int a = -1;
  EXPECT(cache.lookup(request("a"), 2, &a) == ResponseCache::Lookup::kHit);
  cache.touch(a);
  cache.put(response_to(request("c"), 2));
  EXPECT(look(cache, request("a")) == ResponseCache::Lookup::kHit);
  EXPECT(look(cache, request("b")) == ResponseCache::Lookup::kMiss);
  EXPECT(look(cache, request("c")) == ResponseCache::Lookup::kHit);
}

// Where each name sits after a long random run of puts (new names and
// repeats), touches and erases on a small cache: the position a new name
// takes is its cache bit on every rank, so the choice must be exactly the
// rule, not merely some free or old position. The model states the rule as
// plainly as it can: the lowest free position, else the entry used longest
// ago.
UNIT_TEST(positions_are_the_lowest_free_else_the_least_recently_used) {
  const int capacity = 7;
  ResponseCache cache(capacity);
  std::vector<std::string> model_name(capacity);  // "" where free
  std::vector<uint64_t> model_used(capacity, 0);
  uint64_t clock = 0;
  std::mt19937 draw(12345);
  for (int step = 0; step < 5000; ++step) {
    const int what = (int)(draw() % 10);
    const std::string name = "t" + std::to_string(draw() % 12);
    int position = -1;
    const bool cached = cache.lookup(request(name), 2, &position) != ResponseCache::Lookup::kMiss;
    if (what < 6) {  // put
      cache.put(response_to(request(name), 2));
      int p = -1;
      for (int q = 0; q < capacity && p < 0; ++q)
        if (model_name[q] == name) p = q;
      for (int q = 0; q < capacity && p < 0; ++q)
        if (model_name[q].empty()) p = q;
      if (p < 0) {
        p = 0;
        for (int q = 1; q < capacity; ++q)
          if (model_used[q] < model_used[p]) p = q;
      }
      model_name[p] = name;
      model_used[p] = ++clock;
    } else if (cached && what < 8) {
      cache.touch(position);
      model_used[position] = ++clock;
    } else if (cached) {
      cache.erase(position);
      model_name[position].clear();
    }
    for (int q = 0; q < capacity; ++q) {
      EXPECT_EQ(cache.occupied(q), !model_name[q].empty());
      if (model_name[q].empty()) continue;
      int found = -1;
      EXPECT(cache.lookup(request(model_name[q]), 2, &found) == ResponseCache::Lookup::kHit);
      EXPECT_EQ(found, q);
    }
  }
}

UNIT_TEST(a_cache_of_no_capacity_remembers_nothing) {
  ResponseCache cache(0);
  cache.put(response_to(request("a"), 2));
  EXPECT(look(cache, request("a")) == ResponseCache::Lookup::kMiss);
}

UNIT_TEST(barriers_are_never_answered_from_the_cache) {
  ResponseCache cache(4);
  const Request barrier = request("b", UNISON_BARRIER, {});
  cache.put(response_to(barrier, 2));
  EXPECT(look(cache, barrier) != ResponseCache::Lookup::kHit);
}

UNIT_TEST(bit_sets_span_words_and_read_nothing_past_their_end) {
  std::vector<uint64_t> bits;
  for (int p : {0, 63, 64, 130}) unison::set_bit(&bits, p);
  EXPECT_EQ(bits.size(), (size_t)3);
  std::vector<int> seen;
  unison::for_each_set_bit(bits, [&](int p) { seen.push_back(p); });
  EXPECT(seen == (std::vector<int>{0, 63, 64, 130}));
  EXPECT(unison::test_bit(bits, 130) && !unison::test_bit(bits, 129));
  EXPECT(!unison::test_bit(bits, 100000));  // a peer's short vector: not set, not read past
}
