// reduce_f16c.h: Sum and Average of IEEE half values through the F16C
// instructions of x86 CPUs, chosen at run time. reduce.cc's portable
// conversions are integer code of about 5 ns an element: on this project's
// VM a 2-input Sum of 19 MB of halves took 48-71 ms with them and 2.5-3.3 ms
// here, and a float16 allreduce took 2-3.4x as long as a float32 one of the
// same count, so Horovod's Compression.fp16 made every step slower.
#pragma once

#include <cstddef>

#include "reduce.h"

namespace unison {

// Reduces the first count / 8 * 8 of `count` halves as reduce() would, bit
// for bit, and returns how many it did: 0 where this CPU has no F16C, and
// for fewer than two or more than eight inputs. The caller reduces the rest.
size_t sum_halves_with_f16c(const ReduceSpec& spec, const void* const* inputs, int n_inputs, void* out,
                            size_t count, void* also_out);

}  // namespace unison
