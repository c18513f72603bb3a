#include "response_cache.h"

#include "unison.h"

namespace unison {
namespace {

// Whether `request` is what `rank` would send for the cached response.
bool matches(const Response& cached, const Request& request, int size) {
  // A placeholder is negotiated in full: whether every rank's is one is
  // for the coordinator to see.
  if (request.placeholder) return false;
  if (cached.op != request.op || cached.dtype != request.dtype || cached.device != request.device)
    return false;
  const TensorPlan& plan = cached.tensors[0];
  switch (request.op) {
    case UNISON_ALLREDUCE:
    case UNISON_REDUCESCATTER:
      return cached.reduce_op == request.reduce_op && cached.prescale == request.prescale &&
             cached.postscale == request.postscale && plan.shape == request.shape &&
             (request.op == UNISON_ALLREDUCE || plan.splits == request.splits);
    case UNISON_BROADCAST:
      return cached.root == request.root && plan.shape == request.shape;
    case UNISON_ALLGATHER:
    case UNISON_ALLTOALL: {
      if (request.shape.empty() || plan.shape.size() != request.shape.size()) return false;
      for (size_t d = 1; d < request.shape.size(); ++d)
        if (plan.shape[d] != request.shape[d]) return false;
      if ((int)plan.first_dims.size() != size || plan.first_dims[request.rank] != request.shape[0])
        return false;
      if (request.op == UNISON_ALLTOALL) {
        for (int r = 0; r < size; ++r)
          if (plan.splits[(size_t)request.rank * size + r] != request.splits[r]) return false;
      }
      return true;
    }
    default:
      return false;  // barrier and join are never cached
  }
}

}  // namespace

ResponseCache::Lookup ResponseCache::lookup(const Request& request, int size, int* position) const {
  auto it = by_name_.find(request.name);
  if (it == by_name_.end()) return Lookup::kMiss;
  *position = it->second;
  return matches(entries_[it->second].response, request, size) ? Lookup::kHit : Lookup::kStale;
}

ResponseCache::ResponseCache(int capacity) : entries_(capacity) {
  for (int p = 0; p < capacity; ++p) free_.push(p);
}

void ResponseCache::put(const Response& response) {
  if (entries_.empty()) return;
  const std::string& name = response.tensors[0].name;
  auto it = by_name_.find(name);
  int position;
  if (it != by_name_.end()) {
    position = it->second;
  } else {
    if (free_.empty()) erase(in_use_.front());
    position = free_.top();
    free_.pop();
    by_name_[name] = position;
  }
  Entry& e = entries_[position];
  if (e.occupied) in_use_.erase(e.in_use_order);
  e.occupied = true;
  e.response = response;
  e.in_use_order = in_use_.insert(in_use_.end(), position);
}

void ResponseCache::touch(int position) {
  Entry& e = entries_[position];
  if (e.occupied) in_use_.splice(in_use_.end(), in_use_, e.in_use_order);
}

void ResponseCache::erase(int position) {
  Entry& e = entries_[position];
  if (!e.occupied) return;
  by_name_.erase(e.response.tensors[0].name);
  in_use_.erase(e.in_use_order);
  e.occupied = false;
  e.response = Response();
  free_.push(position);
}

void set_bit(std::vector<uint64_t>* bits, int position) {
  size_t word = (size_t)position / 64;
  if (bits->size() <= word) bits->resize(word + 1, 0);
  (*bits)[word] |= 1ull << (position % 64);
}

bool test_bit(const std::vector<uint64_t>& bits, int position) {
  size_t word = (size_t)position / 64;
  return word < bits.size() && (bits[word] >> (position % 64)) & 1;
}

}  // namespace unison
