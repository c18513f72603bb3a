// adasum.h: the Adasum reduction, built on any data plane's collectives.
//
// Adasum combines two gradients a and b as
//     (1 - a.b / 2|a|^2) a  +  (1 - a.b / 2|b|^2) b
// (a coefficient is 1 where its vector is zero): orthogonal gradients add,
// equal ones average, and everything between is weighted by how much the
// two agree. It is not associative, so the order of pairing is part of the
// result:
//   - ranks pair by distance 1, then 2, then 4 (vector halving, distance
//     doubling): rank 0 with 1 and 2 with 3 first, then {0,1} with {2,3}.
//     Neighbouring ranks usually share a host, so the first, largest
//     exchange stays local. This is Horovod's order.
//   - at a size that is not a power of two (Horovod refuses those), the
//     ranks past the largest power of two p first hand their whole
//     gradient to rank r - p, which combines the two; the p ranks then go
//     on as above, and everyone receives the result.
// The dot products and norms are per tensor, even when several tensors are
// fused into one call.
//
// Every exchange is one of the data plane's own collectives (a sparse
// alltoall for each pairwise swap, a small float64 allreduce for each
// level's dot products, one allgather at the end), so Adasum runs on every
// plane and process set without a line of its own in any of them. Each
// rank sends and receives at most about twice the tensor's bytes, whatever
// the number of ranks.
#pragma once

#include <vector>

#include "data_plane.h"
#include "status.h"

namespace unison {

// Adasum across the plane's ranks. `tensors` are the fused tensors, in
// the same order and of the same sizes on every rank; `dtype` is one of
// the floating-point types. Inputs may alias outputs.
Status adasum_allreduce(DataPlane& plane, int dtype, const std::vector<Segment>& tensors);

}  // namespace unison
