// response_cache.h: negotiated responses remembered by position, so that a
// later step with the same tensors agrees through one bit per tensor.
//
// Every rank holds an identical cache: entries are added and evicted only
// as a consequence of responses that every rank executes in the same
// order, so a position means the same tensor everywhere.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"

namespace unison {

class ResponseCache {
 public:
  explicit ResponseCache(int capacity);
  int capacity() const { return (int)entries_.size(); }

  enum class Lookup { kMiss, kHit, kStale };
  // kHit: *position holds a response this rank's request matches exactly.
  // kStale: the name is cached with other parameters at *position.
  Lookup lookup(const Request& request, int size, int* position) const;
  const Response& response(int position) const { return entries_[position].response; }
  bool occupied(int position) const { return entries_[position].occupied; }

  // Remember a single-tensor response at the lowest free position, or when
  // full in place of the least recently used entry. Both choices depend only
  // on the order of puts, touches and erases, which every rank makes alike,
  // and each is O(log capacity): a scan of every position cost each new name
  // 0.8 us at the default 1,024 entries and 265 us at 65,536.
  void put(const Response& response);
  void touch(int position);
  void erase(int position);

 private:
  struct Entry {
    bool occupied = false;
    std::list<int>::iterator in_use_order;  // its place in in_use_, while occupied
    Response response;
  };
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int> by_name_;
  // Occupied positions, least recently used first.
  std::list<int> in_use_;
  // Free positions, lowest first.
  std::priority_queue<int, std::vector<int>, std::greater<int>> free_;
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
