// reduce_f16c.cc: half-precision Sum and Average with F16C (see the header).
//
// The build targets the x86-64 baseline, which has no F16C, so only the
// functions here are compiled for it (the target attribute), and they run
// only after the CPU has said it has it. Their steps are the portable
// kernel's: each half widened to float exactly, scaled, summed in rank
// order, averaged and rounded back to nearest-even, with the same float
// operations. The conversions agree with dtype.h's bit for bit on every
// half and every float but NaN payloads (checked exhaustively, with and
// without flush-to-zero), and a NaN stays a NaN.
#include "reduce_f16c.h"

#include <cstdint>

#include "unison.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace unison {
namespace {

template <int N>
__attribute__((target("avx,f16c"))) void sum_halves(const ReduceSpec& spec, const void* const* inputs, void* out,
                                                     size_t count, void* also_out) {
  const bool average = spec.reduce_op == UNISON_AVERAGE && spec.ranks > 1;
  const bool divide = average && (spec.ranks & (spec.ranks - 1)) != 0;
  const bool prescale = spec.prescale != 1.0, postscale = spec.postscale != 1.0;
  const __m256 factor = _mm256_set1_ps(average && !divide ? 1.0f / (float)spec.ranks : 1.0f);
  const __m256 ranks = _mm256_set1_ps((float)spec.ranks);
  const __m256 pre = _mm256_set1_ps((float)spec.prescale), post = _mm256_set1_ps((float)spec.postscale);
  const uint16_t* in[N];
  for (int k = 0; k < N; ++k) in[k] = static_cast<const uint16_t*>(inputs[k]);
  uint16_t* o = static_cast<uint16_t*>(out);
  uint16_t* also = static_cast<uint16_t*>(also_out);
  for (size_t j = 0; j < count; j += 8) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[0] + j)));
    if (prescale) v = _mm256_mul_ps(v, pre);
    for (int k = 1; k < N; ++k) {
      __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[k] + j)));
      if (prescale) w = _mm256_mul_ps(w, pre);
      v = _mm256_add_ps(v, w);
    }
    v = divide ? _mm256_div_ps(v, ranks) : _mm256_mul_ps(v, factor);
    if (postscale) v = _mm256_mul_ps(v, post);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + j), h);
    if (also != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(also + j), h);
  }
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace

size_t sum_halves_with_f16c(const ReduceSpec& spec, const void* const* inputs, int n, void* out, size_t count,
                            void* also) {
  const size_t whole = count / 8 * 8;
  if (whole == 0 || !cpu_has_f16c()) return 0;
  switch (n) {
    case 2: sum_halves<2>(spec, inputs, out, whole, also); return whole;
    case 3: sum_halves<3>(spec, inputs, out, whole, also); return whole;
    case 4: sum_halves<4>(spec, inputs, out, whole, also); return whole;
    case 5: sum_halves<5>(spec, inputs, out, whole, also); return whole;
    case 6: sum_halves<6>(spec, inputs, out, whole, also); return whole;
    case 7: sum_halves<7>(spec, inputs, out, whole, also); return whole;
    case 8: sum_halves<8>(spec, inputs, out, whole, also); return whole;
  }
  return 0;
}

}  // namespace unison

#else  // other CPUs: the portable kernel does it all

namespace unison {
size_t sum_halves_with_f16c(const ReduceSpec&, const void* const*, int, void*, size_t, void*) { return 0; }
}  // namespace unison

#endif
