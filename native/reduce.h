// reduce.h: the element-wise reductions behind allreduce and reducescatter.
#pragma once

#include <cstddef>

namespace unison {

struct ReduceSpec {
  int dtype = 0;
  int reduce_op = 0;       // UNISON_SUM ... UNISON_PRODUCT (Average divides by `ranks`)
  double prescale = 1.0;   // applied to every input element first
  double postscale = 1.0;  // applied to the result last
  int ranks = 1;           // the divisor of Average
};

// out[i] = postscale * (pre*inputs[0][i] (op) pre*inputs[1][i] (op) ...).
//
// Inputs are combined in the order given, and callers give them in rank
// order, so whichever rank computes an element computes the same bits.
// `out` may alias any input. Half and bfloat16 are accumulated in float and
// rounded once; integers wrap on overflow like the frameworks' own integer
// tensors, and their Average truncates toward zero.
//
// `also_out`, when not null, receives a second copy of the result in the
// same pass: the shared-memory allreduce needs its reduced chunk both in
// its slot (for the peers) and in the caller's output, and writing both
// from registers saves reading the chunk back later.
//
// The kernel takes void pointers and dispatches on dtype inside: one call
// per chunk costs nothing next to the chunk's memory traffic, and it keeps
// the callers free of templates.
void reduce(const ReduceSpec& spec, const void* const* inputs, int n_inputs, void* out,
            size_t count, void* also_out = nullptr);

}  // namespace unison
