#include "adasum.h"

#include <algorithm>
#include <cstring>

#include "copy.h"
#include "dtype.h"

namespace unison {
namespace {

// Stored elements are read and written through double: the dot products
// of a large tensor need its range, and half precision would lose them.
struct Float32 {
  using Storage = float;
  static double load(float v) { return v; }
  static float store(double v) { return (float)v; }
};
struct Float64 {
  using Storage = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};
struct Half {
  using Storage = uint16_t;
  static double load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(double v) { return float_to_half((float)v); }
};
struct BFloat16 {
  using Storage = uint16_t;
  static double load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(double v) { return float_to_bfloat16((float)v); }
};

// What one pairwise step needs from the elements of one tensor's piece.
struct Kernels {
  // sums[0] += a.b, sums[1] += a.a, sums[2] += b.b
  void (*dot_and_norms)(const void* a, const void* b, size_t count, double* sums);
  // mine = my_weight * mine + their_weight * theirs
  void (*weighted_sum)(void* mine, const void* theirs, size_t count, double my_weight, double their_weight);
};

template <typename Codec>
void dot_and_norms(const void* a, const void* b, size_t count, double* sums) {
  using S = typename Codec::Storage;
  const S* x = static_cast<const S*>(a);
  const S* y = static_cast<const S*>(b);
  // Four independent lanes: one chain of dependent additions per sum
  // would leave the multipliers idle, and without -ffast-math the
  // compiler may not reorder them itself.
  constexpr size_t kLanes = 4;
  double dot[kLanes] = {}, xx[kLanes] = {}, yy[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) {
      const double u = Codec::load(x[i + l]), v = Codec::load(y[i + l]);
      dot[l] += u * v;
      xx[l] += u * u;
      yy[l] += v * v;
    }
  }
  for (; i < count; ++i) {
    const double u = Codec::load(x[i]), v = Codec::load(y[i]);
    dot[0] += u * v;
    xx[0] += u * u;
    yy[0] += v * v;
  }
  sums[0] += (dot[0] + dot[1]) + (dot[2] + dot[3]);
  sums[1] += (xx[0] + xx[1]) + (xx[2] + xx[3]);
  sums[2] += (yy[0] + yy[1]) + (yy[2] + yy[3]);
}

template <typename Codec>
void weighted_sum(void* mine, const void* theirs, size_t count, double my_weight, double their_weight) {
  using S = typename Codec::Storage;
  S* x = static_cast<S*>(mine);
  const S* y = static_cast<const S*>(theirs);
  for (size_t i = 0; i < count; ++i)
    x[i] = Codec::store(my_weight * Codec::load(x[i]) + their_weight * Codec::load(y[i]));
}

template <typename Codec>
constexpr Kernels kernels_of() {
  return Kernels{&dot_and_norms<Codec>, &weighted_sum<Codec>};
}

Kernels kernels_for(int dtype) {
  switch (dtype) {
    case UNISON_FLOAT16: return kernels_of<Half>();
    case UNISON_BFLOAT16: return kernels_of<BFloat16>();
    case UNISON_FLOAT32: return kernels_of<Float32>();
    default: return kernels_of<Float64>();
  }
}

// a's and b's weights from one tensor's dot product and squared norms.
void weights(const double* sums, double* a_weight, double* b_weight) {
  const double dot = sums[0], aa = sums[1], bb = sums[2];
  *a_weight = aa > 0 ? 1.0 - dot / (2.0 * aa) : 1.0;
  *b_weight = bb > 0 ? 1.0 - dot / (2.0 * bb) : 1.0;
}

// The fused tensors as one stream of elements: tensor t holds elements
// [first[t], first[t + 1]).
class Stream {
 public:
  Stream(const std::vector<Segment>& tensors, size_t element) : tensors_(tensors), element_(element) {
    first_.push_back(0);
    for (const Segment& t : tensors) first_.push_back(first_.back() + t.bytes / element);
  }
  size_t elements() const { return first_.back(); }
  size_t tensors() const { return tensors_.size(); }

  // Calls fn(t, begin, end) for each tensor t that elements [begin, end)
  // overlap, with the overlap.
  template <typename Fn>
  void each_tensor_in(size_t begin, size_t end, Fn fn) const {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const size_t b = std::max(begin, first_[t]), e = std::min(end, first_[t + 1]);
      if (b < e) fn(t, b, e);
    }
  }
  void gather_inputs(char* into) const {
    for (size_t t = 0; t < tensors_.size(); ++t)
      if (tensors_[t].bytes > 0) copy_bytes(into + first_[t] * element_, tensors_[t].input, tensors_[t].bytes);
  }
  // Writes `count` elements of the stream, starting at element `begin`,
  // into the tensors' outputs.
  void write_outputs(size_t begin, const char* from, size_t count) const {
    each_tensor_in(begin, begin + count, [&](size_t t, size_t b, size_t e) {
      move_bytes(static_cast<char*>(tensors_[t].output) + (b - first_[t]) * element_,
                   from + (b - begin) * element_, (e - b) * element_);
    });
  }

 private:
  const std::vector<Segment>& tensors_;
  size_t element_;
  std::vector<size_t> first_;
};

}  // namespace

Status adasum_allreduce(DataPlane& plane, int dtype, const std::vector<Segment>& tensors) {
  const size_t element = dtype_size(dtype);
  const Stream stream(tensors, element);
  const size_t total = stream.elements();
  const int size = plane.size(), rank = plane.rank();
  // Every rank has the same tensors, so every rank takes this exit or none.
  if (size == 1 || total == 0) {
    for (const Segment& t : tensors)
      if (t.bytes > 0 && t.output != t.input) copy_bytes(t.output, t.input, t.bytes);
    return Status::OK();
  }
  const Kernels kernels = kernels_for(dtype);
  const size_t n_tensors = stream.tensors();
  // Kept between calls (only the engine's thread runs collectives): fresh
  // buffers of a gradient's size would cost a page fault every 4 KiB.
  static thread_local std::vector<char> mine, theirs;
  if (mine.size() < total * element) {
    mine.resize(total * element);
    theirs.resize(total * element);
  }
  stream.gather_inputs(mine.data());
  auto at = [&](std::vector<char>& buffer, size_t index) { return buffer.data() + index * element; };

  int p = 1;
  while (p * 2 <= size) p *= 2;
  Status status;

  // Ranks p.. hand their gradient to rank r - p, which folds it into its own.
  if (size > p) {
    AlltoallOptions fold;
    fold.bytes.assign((size_t)size * size, 0);
    for (int s = p; s < size; ++s) fold.bytes[(size_t)s * size + (s - p)] = total * element;
    fold.input = mine.data();
    fold.output = theirs.data();
    status = plane.alltoall(fold);
    if (!status.ok()) return status;
    if (rank < size - p) {
      std::vector<double> sums(3 * n_tensors, 0.0);
      stream.each_tensor_in(0, total, [&](size_t t, size_t b, size_t e) {
        kernels.dot_and_norms(at(mine, b), at(theirs, b), e - b, &sums[3 * t]);
      });
      stream.each_tensor_in(0, total, [&](size_t t, size_t b, size_t e) {
        double a_weight, b_weight;
        weights(&sums[3 * t], &a_weight, &b_weight);
        kernels.weighted_sum(at(mine, b), at(theirs, b), e - b, a_weight, b_weight);
      });
    }
  }

  // Vector halving, distance doubling among ranks 0..p-1. Rank s holds the
  // stream's elements [begin[s], end[s]) of its group's combined gradient;
  // partners (s and s ^ distance) hold the same range, each keeps one half
  // and receives the partner's values for it.
  std::vector<size_t> begin(size, 0), end(size, 0);
  for (int s = 0; s < p; ++s) end[s] = total;
  for (int distance = 1; distance < p; distance *= 2) {
    AlltoallOptions swap;
    swap.bytes.assign((size_t)size * size, 0);
    std::vector<size_t> kept_begin(begin), kept_end(end);
    for (int s = 0; s < p; ++s) {
      const size_t middle = begin[s] + (end[s] - begin[s]) / 2;
      const bool keeps_low = (s & distance) == 0;
      kept_begin[s] = keeps_low ? begin[s] : middle;
      kept_end[s] = keeps_low ? middle : end[s];
      swap.bytes[(size_t)s * size + (s ^ distance)] = ((end[s] - begin[s]) - (kept_end[s] - kept_begin[s])) * element;
    }
    const bool left = (rank & distance) == 0;  // in the group whose gradient is "a"
    // Ranks p.. send nothing, but every rank names a real buffer.
    swap.input = rank < p ? at(mine, left ? kept_end[rank] : begin[rank]) : mine.data();
    swap.output = theirs.data();
    status = plane.alltoall(swap);
    if (!status.ok()) return status;

    // Each group of 2*distance ranks holds one pair (a, b) spread over its
    // members; summing their partial dot products gives the pair's.
    const size_t groups = (size_t)p / (2 * distance);
    std::vector<double> sums(3 * n_tensors * groups, 0.0);
    const size_t kb = kept_begin[rank < p ? rank : 0], ke = kept_end[rank < p ? rank : 0];
    double* my_group = rank < p ? &sums[3 * n_tensors * (rank / (2 * distance))] : nullptr;
    if (rank < p) {
      stream.each_tensor_in(kb, ke, [&](size_t t, size_t b, size_t e) {
        double* s = my_group + 3 * t;
        if (left) {
          kernels.dot_and_norms(at(mine, b), theirs.data() + (b - kb) * element, e - b, s);
        } else {  // a is the partner's, b mine: swap the two norms into place
          kernels.dot_and_norms(theirs.data() + (b - kb) * element, at(mine, b), e - b, s);
        }
      });
    }
    AllreduceOptions reduce;
    reduce.segments.push_back({sums.data(), sums.data(), sums.size() * sizeof(double)});
    reduce.reduce = ReduceSpec{UNISON_FLOAT64, UNISON_SUM, 1.0, 1.0, size};
    status = plane.allreduce(reduce);
    if (!status.ok()) return status;
    if (rank < p) {
      stream.each_tensor_in(kb, ke, [&](size_t t, size_t b, size_t e) {
        double a_weight, b_weight;
        weights(my_group + 3 * t, &a_weight, &b_weight);
        kernels.weighted_sum(at(mine, b), theirs.data() + (b - kb) * element, e - b, left ? a_weight : b_weight,
                             left ? b_weight : a_weight);
      });
    }
    begin.swap(kept_begin);
    end.swap(kept_end);
  }

  // Ranks 0..p-1 now hold disjoint pieces of the result that cover it;
  // one allgather gives everyone all of them (in rank order, which is not
  // stream order, so each piece is then put in its place).
  AllgatherOptions gather;
  AllgatherOptions::Tensor all;
  all.input = at(mine, begin[rank]);
  all.output = theirs.data();
  for (int s = 0; s < size; ++s) all.bytes_per_rank.push_back((end[s] - begin[s]) * element);
  gather.tensors.push_back(all);
  status = plane.allgather(gather);
  if (!status.ok()) return status;
  size_t offset = 0;
  for (int s = 0; s < size; ++s) {
    stream.write_outputs(begin[s], theirs.data() + offset * element, end[s] - begin[s]);
    offset += end[s] - begin[s];
  }
  return Status::OK();
}

}  // namespace unison
