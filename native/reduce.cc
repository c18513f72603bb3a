#include "reduce.h"

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "copy.h"
#include "dtype.h"
#include "reduce_f16c.h"

namespace unison {
namespace {

// How a stored element becomes a value to compute with, and back.
template <typename T>
struct NativeCodec {
  using Storage = T;
  using Compute = T;
  static Compute load(T v) { return v; }
  static T store(Compute c) { return c; }
};
struct HalfCodec {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float c) { return float_to_half(c); }
};
struct BFloat16Codec {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float c) { return float_to_bfloat16(c); }
};

template <typename C>
inline C scale(C v, double factor) {
  if constexpr (std::is_floating_point_v<C>) {
    return v * (C)factor;
  } else {
    return (C)((double)v * factor);  // integers: scale in double, truncate
  }
}

// Wrapping integer arithmetic without signed-overflow undefined behaviour:
// computed in an unsigned type at least as wide as `unsigned`, because
// narrower ones are promoted to (signed) int first, where 65535 * 65535
// would overflow.
template <typename C>
using Wide = std::conditional_t<(sizeof(C) < sizeof(unsigned)), unsigned, std::make_unsigned_t<C>>;
template <typename C>
inline C add(C a, C b) {
  if constexpr (std::is_floating_point_v<C>) {
    return a + b;
  } else {
    using U = Wide<C>;
    return (C)(U)((U)a + (U)b);
  }
}
template <typename C>
inline C multiply(C a, C b) {
  if constexpr (std::is_floating_point_v<C>) {
    return a * b;
  } else {
    using U = Wide<C>;
    return (C)(U)((U)a * (U)b);
  }
}
// Min and max propagate NaN, as numpy and torch do (a != a only for NaN).
template <typename C>
inline C minimum(C a, C b) { return (a < b || a != a) ? a : b; }
template <typename C>
inline C maximum(C a, C b) { return (a > b || a != a) ? a : b; }

struct Sum { template <typename C> static C apply(C a, C b) { return add(a, b); } };
struct Min { template <typename C> static C apply(C a, C b) { return minimum(a, b); } };
struct Max { template <typename C> static C apply(C a, C b) { return maximum(a, b); } };
struct Product { template <typename C> static C apply(C a, C b) { return multiply(a, b); } };
struct Or { template <typename C> static C apply(C a, C b) { return (C)((a != 0) | (b != 0)); } };
struct And { template <typename C> static C apply(C a, C b) { return (C)((a != 0) & (b != 0)); } };

// The accumulator block stays in L1 while every input streams past it once.
constexpr size_t kBlock = 512;

template <typename Codec, typename Combine>
void reduce_typed(const ReduceSpec& spec, const void* const* inputs, int n_inputs, void* out,
                  size_t count, void* also_out) {
  using T = typename Codec::Storage;
  using C = typename Codec::Compute;
  const bool prescale = spec.prescale != 1.0;
  const bool postscale = spec.postscale != 1.0;
  const bool average = spec.reduce_op == UNISON_AVERAGE && spec.ranks > 1;
  // A float divided by a power of two and multiplied by its reciprocal are
  // the same number rounded once, so the same bits; the multiply costs a
  // fraction of the division (an Average of 2 MiB on 2 ranks took 1.6x a
  // Sum's time with the division, in L3, on this project's VM).
  const bool by_reciprocal = std::is_floating_point_v<C> && (spec.ranks & (spec.ranks - 1)) == 0;
  const C reciprocal = (C)1 / (C)spec.ranks;
  C acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(inputs[0]) + base;
    for (size_t j = 0; j < m; ++j) acc[j] = Codec::load(first[j]);
    if (prescale) for (size_t j = 0; j < m; ++j) acc[j] = scale(acc[j], spec.prescale);
    for (int k = 1; k < n_inputs; ++k) {
      const T* in = static_cast<const T*>(inputs[k]) + base;
      if (prescale) {
        for (size_t j = 0; j < m; ++j)
          acc[j] = Combine::apply(acc[j], scale(Codec::load(in[j]), spec.prescale));
      } else {
        for (size_t j = 0; j < m; ++j) acc[j] = Combine::apply(acc[j], Codec::load(in[j]));
      }
    }
    if (average && by_reciprocal) {
      for (size_t j = 0; j < m; ++j) acc[j] = acc[j] * reciprocal;
    } else if (average) {
      const C ranks = (C)spec.ranks;
      for (size_t j = 0; j < m; ++j) acc[j] = acc[j] / ranks;
    }
    if (postscale) for (size_t j = 0; j < m; ++j) acc[j] = scale(acc[j], spec.postscale);
    T* o = static_cast<T*>(out) + base;
    for (size_t j = 0; j < m; ++j) o[j] = Codec::store(acc[j]);
    if (also_out != nullptr) copy_bytes(static_cast<T*>(also_out) + base, o, m * sizeof(T));
  }
}

// x86-64 builds target the baseline CPU, so the one-pass loops below also
// get an AVX2 clone, which the loader picks where the CPU has AVX2 (no FMA:
// the same roundings, the same bits). bfloat16's conversions run twice as
// fast in it (a 2-input Average of 19 MB: 4.8-5.2 ms against 10.2-10.4);
// float and double, bound by memory, do not change.
#if defined(__x86_64__)
#define WITH_AN_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define WITH_AN_AVX2_CLONE
#endif

// Sum and Average in one pass, for the types computed in floating point
// (float, double, bfloat16; half goes to reduce_f16c.cc's kernel where the
// CPU has one) and up to eight inputs. Each element is read from every
// input, combined in registers and written to both outputs in the same
// loop, so the memory streams run side by side. The blocked kernel above
// makes one pass per input over an L1 block instead; on this project's
// 2-core VM it took 1.4-1.6x as long for a 2-input float32 Sum of 19 MB
// whose first input came from DRAM (the shared-memory allreduce's REDUCE
// step), 1.9x for an Average, and 1.2-2.3x in L1 and L2. The steps are the
// blocked kernel's, in its order (inputs in rank order, an Average by a
// power of two as a multiply by its reciprocal), so are the bits.
// `kPlain` (no scale factors, no division) is the loop every gradient takes.
template <typename Codec, int N, bool kPlain>
WITH_AN_AVX2_CLONE void sum_in_one_pass(const ReduceSpec& spec, const void* const* inputs, void* out, size_t count,
                     void* also_out) {
  using T = typename Codec::Storage;
  using C = typename Codec::Compute;
  const bool average = spec.reduce_op == UNISON_AVERAGE && spec.ranks > 1;
  const bool divide = average && (spec.ranks & (spec.ranks - 1)) != 0;
  const C factor = average && !divide ? (C)1 / (C)spec.ranks : (C)1;  // 1 changes no bits
  const C ranks = (C)spec.ranks;
  const C pre = (C)spec.prescale, post = (C)spec.postscale;
  const bool prescale = !kPlain && spec.prescale != 1.0, postscale = !kPlain && spec.postscale != 1.0;
  const T* in[N];
  for (int k = 0; k < N; ++k) in[k] = static_cast<const T*>(inputs[k]);
  T* o = static_cast<T*>(out);
  T* also = static_cast<T*>(also_out);
  auto element = [&](size_t j) {
    C v = Codec::load(in[0][j]);
    if (prescale) v = v * pre;
    for (int k = 1; k < N; ++k) {
      C w = Codec::load(in[k][j]);
      if (prescale) w = w * pre;
      v = v + w;
    }
    v = !kPlain && divide ? v / ranks : v * factor;
    if (postscale) v = v * post;
    return Codec::store(v);
  };
  if (also != nullptr) {
    for (size_t j = 0; j < count; ++j) {
      const T v = element(j);
      o[j] = v;
      also[j] = v;
    }
  } else {
    for (size_t j = 0; j < count; ++j) o[j] = element(j);
  }
}

template <typename Codec, bool kPlain>
bool sum_in_one_pass_of(const ReduceSpec& spec, const void* const* inputs, int n, void* out, size_t count,
                        void* also) {
  switch (n) {
    case 2: sum_in_one_pass<Codec, 2, kPlain>(spec, inputs, out, count, also); return true;
    case 3: sum_in_one_pass<Codec, 3, kPlain>(spec, inputs, out, count, also); return true;
    case 4: sum_in_one_pass<Codec, 4, kPlain>(spec, inputs, out, count, also); return true;
    case 5: sum_in_one_pass<Codec, 5, kPlain>(spec, inputs, out, count, also); return true;
    case 6: sum_in_one_pass<Codec, 6, kPlain>(spec, inputs, out, count, also); return true;
    case 7: sum_in_one_pass<Codec, 7, kPlain>(spec, inputs, out, count, also); return true;
    case 8: sum_in_one_pass<Codec, 8, kPlain>(spec, inputs, out, count, also); return true;
  }
  return false;
}

// Runs a one-pass Sum or Average where one applies; false where the blocked
// kernel must (integers, whose Average truncates; more than eight inputs).
template <typename Codec>
bool summed_in_one_pass(const ReduceSpec& spec, const void* const* inputs, int n, void* out, size_t count,
                        void* also) {
  if constexpr (std::is_same_v<Codec, HalfCodec>) {
    const size_t done = sum_halves_with_f16c(spec, inputs, n, out, count, also);
    if (done == 0) return false;
    if (done < count) {  // the last few elements, portably
      const void* rest[8];
      for (int k = 0; k < n; ++k) rest[k] = static_cast<const uint16_t*>(inputs[k]) + done;
      reduce_typed<HalfCodec, Sum>(spec, rest, n, static_cast<uint16_t*>(out) + done, count - done,
                                   also != nullptr ? static_cast<uint16_t*>(also) + done : nullptr);
    }
    return true;
  } else if constexpr (std::is_floating_point_v<typename Codec::Compute>) {
    const bool average = spec.reduce_op == UNISON_AVERAGE && spec.ranks > 1;
    const bool plain = spec.prescale == 1.0 && spec.postscale == 1.0 &&
                       !(average && (spec.ranks & (spec.ranks - 1)) != 0);
    return plain ? sum_in_one_pass_of<Codec, true>(spec, inputs, n, out, count, also)
                 : sum_in_one_pass_of<Codec, false>(spec, inputs, n, out, count, also);
  }
  return false;
}

template <typename Codec>
void reduce_with_op(const ReduceSpec& spec, const void* const* inputs, int n, void* out,
                    size_t count, void* also) {
  switch (spec.reduce_op) {
    case UNISON_SUM:
    case UNISON_AVERAGE:
      if (summed_in_one_pass<Codec>(spec, inputs, n, out, count, also)) return;
      return reduce_typed<Codec, Sum>(spec, inputs, n, out, count, also);
    case UNISON_MIN: return reduce_typed<Codec, Min>(spec, inputs, n, out, count, also);
    case UNISON_MAX: return reduce_typed<Codec, Max>(spec, inputs, n, out, count, also);
    case UNISON_PRODUCT: return reduce_typed<Codec, Product>(spec, inputs, n, out, count, also);
  }
}

void reduce_bool(const ReduceSpec& spec, const void* const* inputs, int n, void* out, size_t count,
                 void* also) {
  // Sum and Max mean "any"; Min and Product mean "all". Average is refused
  // at enqueue, and scale factors have no meaning here.
  ReduceSpec plain = spec;
  plain.prescale = plain.postscale = 1.0;
  if (spec.reduce_op == UNISON_SUM || spec.reduce_op == UNISON_MAX) {
    reduce_typed<NativeCodec<uint8_t>, Or>(plain, inputs, n, out, count, also);
  } else {
    reduce_typed<NativeCodec<uint8_t>, And>(plain, inputs, n, out, count, also);
  }
}

}  // namespace

void reduce(const ReduceSpec& spec, const void* const* inputs, int n_inputs, void* out,
            size_t count, void* also_out) {
  if (count == 0 || n_inputs == 0) return;
  switch (spec.dtype) {
    case UNISON_UINT8: return reduce_with_op<NativeCodec<uint8_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_INT8: return reduce_with_op<NativeCodec<int8_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_INT16: return reduce_with_op<NativeCodec<int16_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_UINT16: return reduce_with_op<NativeCodec<uint16_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_UINT32: return reduce_with_op<NativeCodec<uint32_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_UINT64: return reduce_with_op<NativeCodec<uint64_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_INT32: return reduce_with_op<NativeCodec<int32_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_INT64: return reduce_with_op<NativeCodec<int64_t>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_FLOAT16: return reduce_with_op<HalfCodec>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_BFLOAT16: return reduce_with_op<BFloat16Codec>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_FLOAT32: return reduce_with_op<NativeCodec<float>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_FLOAT64: return reduce_with_op<NativeCodec<double>>(spec, inputs, n_inputs, out, count, also_out);
    case UNISON_BOOL: return reduce_bool(spec, inputs, n_inputs, out, count, also_out);
  }
}

}  // namespace unison
