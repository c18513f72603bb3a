// byte_stream.h: a list of buffers read or written as one run of bytes.
//
// Fused collectives treat their tensors as one logical stream so that a
// backend can cut it into rounds and chunks without caring where one tensor
// ends and the next begins. These helpers map a range of the stream back
// onto the buffers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "copy.h"

namespace unison {

struct Span {
  char* data;
  size_t bytes;
};

class ByteStream {
 public:
  void append(const void* data, size_t bytes) {
    if (bytes == 0) return;
    spans_.push_back({const_cast<char*>(static_cast<const char*>(data)), bytes});
    starts_.push_back(total_);
    total_ += bytes;
  }
  size_t size() const { return total_; }

  // Calls fn(stream_offset, pointer, bytes) for each piece of [lo, hi).
  template <typename Fn>
  void for_each(size_t lo, size_t hi, Fn&& fn) const {
    if (lo >= hi) return;
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), lo) - starts_.begin() - 1;
    for (; i < spans_.size() && starts_[i] < hi; ++i) {
      size_t begin = std::max(lo, starts_[i]);
      size_t end = std::min(hi, starts_[i] + spans_[i].bytes);
      if (begin < end) fn(begin, spans_[i].data + (begin - starts_[i]), end - begin);
    }
  }
  // Copies stream[lo, hi) to dst.
  void read(size_t lo, size_t hi, void* dst) const {
    char* out = static_cast<char*>(dst);
    for_each(lo, hi, [&](size_t at, char* p, size_t n) { copy_bytes(out + (at - lo), p, n); });
  }
  // Copies src into stream[lo, hi).
  void write(size_t lo, size_t hi, const void* src) const {
    const char* in = static_cast<const char*>(src);
    for_each(lo, hi, [&](size_t at, char* p, size_t n) { copy_bytes(p, in + (at - lo), n); });
  }

 private:
  std::vector<Span> spans_;
  std::vector<size_t> starts_;
  size_t total_ = 0;
};

}  // namespace unison
