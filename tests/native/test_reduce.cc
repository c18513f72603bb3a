// The reduction kernel (native/reduce.cc) over a grid: every real dtype x
// element counts {0, 1, 17, 513, 4099} (across its 512-element blocks) x
// Sum, Average, Min, Max, Product x 1, 2, 3, 8 and 9 inputs (it has a path
// per input count up to eight and one beyond), against a plain fold of the
// same inputs in rank order: integers wrapping and truncating as the
// frameworks' do, half and bfloat16 computed in float and rounded once,
// bool's Sum and Max as "any" and Min and Product as "all". Every element
// must be the same bits; the result must also be right written over the
// first input, and copied to a second output when one is given.
#define UNIT_FILE "reduce"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "reduce.h"
#include "unit.h"
#include "unison.h"

namespace {

const int kCounts[] = {0, 1, 17, 513, 4099};
const int kInputs[] = {1, 2, 3, 8, 9};
const int kOps[] = {UNISON_SUM, UNISON_AVERAGE, UNISON_MIN, UNISON_MAX, UNISON_PRODUCT};

// A small signed value per (input, element): small enough that a float's
// fold stays exact-ish, varied enough that Min and Max pick different ranks.
int pattern(int input, int element) { return (int)((input * 7919 + element * 104729) % 7) - 3; }

template <typename T>
using WideOf = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

// The fold in compute type C, as the frameworks define each op.
template <typename C>
C combine(int op, C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    using U = WideOf<C>;
    if (op == UNISON_SUM || op == UNISON_AVERAGE) return (C)(U)((U)a + (U)b);
    if (op == UNISON_PRODUCT) return (C)(U)((U)a * (U)b);
  } else {
    if (op == UNISON_SUM || op == UNISON_AVERAGE) return a + b;
    if (op == UNISON_PRODUCT) return a * b;
  }
  if (op == UNISON_MIN) return a < b ? a : b;
  return a > b ? a : b;
}

template <typename C>
C finish(int op, C acc, int ranks) {
  if (op != UNISON_AVERAGE || ranks == 1) return acc;
  if constexpr (std::is_floating_point_v<C>) {
    // A power of two: the reciprocal's product is the quotient, rounded once.
    return (ranks & (ranks - 1)) == 0 ? acc * ((C)1 / (C)ranks) : acc / (C)ranks;
  } else {
    return (C)(acc / (C)ranks);  // truncates toward zero
  }
}

// T: storage; C: compute; load/store convert.
template <typename T, typename C, typename Load, typename Store>
void grid(int dtype, const char* label, Load load, Store store) {
  for (int count : kCounts)
    for (int n : kInputs)
      for (int op : kOps) {
        std::vector<std::vector<T>> inputs(n, std::vector<T>(count));
        for (int k = 0; k < n; ++k)
          for (int i = 0; i < count; ++i) inputs[k][i] = store((C)pattern(k, i));
        std::vector<T> expected(count);
        for (int i = 0; i < count; ++i) {
          C acc = load(inputs[0][i]);
          for (int k = 1; k < n; ++k) acc = combine<C>(op, acc, load(inputs[k][i]));
          expected[i] = store(finish<C>(op, acc, n));
        }
        std::vector<const void*> pointers;
        for (auto& in : inputs) pointers.push_back(in.data());
        unison::ReduceSpec spec;
        spec.dtype = dtype;
        spec.reduce_op = op;
        spec.ranks = n;
        std::vector<T> out(count), copy(count);
        unison::reduce(spec, pointers.data(), n, out.data(), count, copy.data());
        const std::string where = std::string(label) + " " + unison::reduce_op_name(op) + " of " +
                                  std::to_string(n) + " x " + std::to_string(count);
        if (std::memcmp(out.data(), expected.data(), count * sizeof(T)) != 0)
          unit::fail(__FILE__, __LINE__, where + ": a result differs from the fold");
        if (std::memcmp(copy.data(), expected.data(), count * sizeof(T)) != 0)
          unit::fail(__FILE__, __LINE__, where + ": the second output differs");
        // Written over the first input.
        unison::reduce(spec, pointers.data(), n, inputs[0].data(), count);
        if (std::memcmp(inputs[0].data(), expected.data(), count * sizeof(T)) != 0)
          unit::fail(__FILE__, __LINE__, where + ": written over its first input, a result differs");
      }
}

template <typename T>
void native_grid(int dtype, const char* label) {
  grid<T, T>(dtype, label, [](T v) { return v; }, [](T c) { return c; });
}

}  // namespace

UNIT_TEST(integers_wrap_and_their_average_truncates) {
  native_grid<uint8_t>(UNISON_UINT8, "uint8");
  native_grid<int8_t>(UNISON_INT8, "int8");
  native_grid<uint16_t>(UNISON_UINT16, "uint16");
  native_grid<int16_t>(UNISON_INT16, "int16");
  native_grid<uint32_t>(UNISON_UINT32, "uint32");
  native_grid<int32_t>(UNISON_INT32, "int32");
  native_grid<uint64_t>(UNISON_UINT64, "uint64");
  native_grid<int64_t>(UNISON_INT64, "int64");
}

UNIT_TEST(floats_fold_in_rank_order) {
  native_grid<float>(UNISON_FLOAT32, "float32");
  native_grid<double>(UNISON_FLOAT64, "float64");
}

UNIT_TEST(half_and_bfloat16_are_computed_in_float_and_rounded_once) {
  grid<uint16_t, float>(UNISON_FLOAT16, "float16", unison::half_to_float, unison::float_to_half);
  grid<uint16_t, float>(UNISON_BFLOAT16, "bfloat16", unison::bfloat16_to_float, unison::float_to_bfloat16);
}

UNIT_TEST(bool_sum_and_max_are_any_min_and_product_all) {
  const uint8_t a[] = {0, 0, 1, 1}, b[] = {0, 1, 0, 1};
  const void* inputs[] = {a, b};
  const std::pair<int, std::vector<uint8_t>> cases[] = {
      {UNISON_SUM, {0, 1, 1, 1}}, {UNISON_MAX, {0, 1, 1, 1}}, {UNISON_MIN, {0, 0, 0, 1}}, {UNISON_PRODUCT, {0, 0, 0, 1}}};
  for (const auto& [op, expected] : cases) {
    unison::ReduceSpec spec;
    spec.dtype = UNISON_BOOL;
    spec.reduce_op = op;
    spec.ranks = 2;
    std::vector<uint8_t> out(4);
    unison::reduce(spec, inputs, 2, out.data(), 4);
    EXPECT(out == expected);
  }
}

UNIT_TEST(min_and_max_propagate_nan_as_numpy_does) {
  const float a[] = {1.0f, NAN, 3.0f}, b[] = {NAN, 2.0f, 1.0f};
  const void* inputs[] = {a, b};
  for (int op : {UNISON_MIN, UNISON_MAX}) {
    unison::ReduceSpec spec;
    spec.dtype = UNISON_FLOAT32;
    spec.reduce_op = op;
    spec.ranks = 2;
    float out[3];
    unison::reduce(spec, inputs, 2, out, 3);
    EXPECT(std::isnan(out[0]) && std::isnan(out[1]));
    EXPECT_EQ(out[2], op == UNISON_MIN ? 1.0f : 3.0f);
  }
}
