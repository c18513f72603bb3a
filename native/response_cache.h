// response_cache.h: negotiated responses remembered by position, so that a
// later step with the same tensors agrees through one bit per tensor.
//
// Every rank holds an identical cache: entries are added and evicted only
// as a consequence of responses that every rank executes in the same
// order, so a position means the same tensor everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"

namespace unison {

class ResponseCache {
 public:
  explicit ResponseCache(int capacity) : entries_(capacity) {}
  int capacity() const { return (int)entries_.size(); }

  enum class Lookup { kMiss, kHit, kStale };
  // kHit: *position holds a response this rank's request matches exactly.
  // kStale: the name is cached with other parameters at *position.
  Lookup lookup(const Request& request, int size, int* position) const;
  const Response& response(int position) const { return entries_[position].response; }
  bool occupied(int position) const { return entries_[position].occupied; }

  // Remember a single-tensor response; evicts the least recently used entry
  // when full.
  void put(const Response& response);
  void touch(int position) { entries_[position].last_used = ++clock_; }
  void erase(int position);

 private:
  struct Entry {
    bool occupied = false;
    uint64_t last_used = 0;
    Response response;
  };
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int> by_name_;
  uint64_t clock_ = 0;
};

// Bit sets over cache positions, as carried in CycleMessage.
void set_bit(std::vector<uint64_t>* bits, int position);
bool test_bit(const std::vector<uint64_t>& bits, int position);
// fn(position) for each set bit, in increasing order: a cycle scans the
// words, not the cache's every position.
template <typename Fn>
void for_each_set_bit(const std::vector<uint64_t>& bits, Fn&& fn) {
  for (size_t w = 0; w < bits.size(); ++w)
    for (uint64_t word = bits[w]; word != 0; word &= word - 1)
      fn((int)(w * 64 + (size_t)__builtin_ctzll(word)));
}

}  // namespace unison
