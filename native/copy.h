// copy.h: how the data planes copy tensor bytes.
//
// Why not memcpy alone. glibc (2.36, seen on this project's AMD EPYC VM)
// copies 2 KiB to 512 KiB with `rep movsb`, and on that CPU `rep movsb`
// runs at about a tenth of its speed (2.9 against 25-30 GB/s in cache) when
// the destination lies 1 to 31 bytes past the source modulo 4 KiB. glibc has
// a switch for exactly this (Avoid_Short_Distance_REP_MOVSB) but sets it on
// some Intel CPUs only. A collective hits that distance as a matter of course:
// a numpy array of 128 KiB or more starts 16 bytes into a page, the shared
// slots start on one, and a fused group shifts every later tensor by the
// bytes of an odd-sized bias. 200 tensors of 40 KB viewed from one array
// took 2.1-2.5x as long to allreduce as 200 separate ones, all of it in
// these copies.
#pragma once

#include <cstddef>

namespace unison {

// memcpy, except at the distances above, where it copies with 16-byte
// vector loads and stores (as fast as memcpy's best at every distance).
void copy_bytes(void* to, const void* from, size_t bytes);

// memmove: copy_bytes where the two do not overlap.
void move_bytes(void* to, const void* from, size_t bytes);

}  // namespace unison
