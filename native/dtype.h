// dtype.h: element types, their sizes and names, and the 16-bit float
// conversions the reductions need.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "unison.h"

namespace unison {

bool dtype_valid(int dtype);
size_t dtype_size(int dtype);
const char* dtype_name(int dtype);
bool dtype_is_float(int dtype);
bool dtype_is_complex(int dtype);
// The type a reduction combines: a complex number's parts are summed (and
// scaled) as two reals, each alike on every rank, so complex64 reduces as
// twice as many float32s; every other type as itself.
int reduced_as(int dtype);
const char* op_name(int op);
const char* reduce_op_name(int reduce_op);

// IEEE half and bfloat16 are stored as uint16_t and reduced in float. The
// conversions are written out with integer operations because the x86-64
// baseline has no F16C instructions and we do not build with -march=native;
// reduce_f16c.cc uses F16C where the CPU has it, and agrees with these bit
// for bit.
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: renormalise
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ff;
    bits = sign | ((uint32_t)(113 - shift) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000;
  uint32_t abs = bits & 0x7fffffff;
  if (abs >= 0x7f800000u) {  // inf or NaN (keep NaN quiet and non-zero)
    return (uint16_t)(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  }
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // overflow to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return (uint16_t)sign;
    uint32_t exponent = abs >> 23;
    uint32_t mantissa = (abs & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - exponent;  // 14..24
    uint32_t half_mantissa = mantissa >> shift;
    uint32_t remainder = mantissa & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1))) ++half_mantissa;
    return (uint16_t)(sign | half_mantissa);
  }
  uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
  return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

inline float bfloat16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bfloat16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

}  // namespace unison
