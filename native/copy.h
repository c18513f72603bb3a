// copy.h: how the data planes copy tensor bytes.
//
// Why not memcpy alone. glibc (2.36, seen on this project's AMD EPYC VMs)
// copies 2 KiB up to the L2 cache's size with `rep movsb`, and on that CPU
// `rep movsb` runs at about a tenth of its speed (2.4-3.5 against 30-55
// GB/s in cache) when the destination lies a few bytes past the source
// modulo 4 KiB: 1 to 31 bytes on one VM, 1 to 15 on another. glibc has
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

// memcpy, except at distances of 1 to 63 bytes in `rep movsb`'s range of
// sizes, where it copies with 16-byte vector loads and stores: 34-42 GB/s
// there, against memcpy's 2.4-3.5, and at least memcpy's speed at the
// distances (16 to 63) that were slow on one VM and not on another.
void copy_bytes(void* to, const void* from, size_t bytes);

// memmove: copy_bytes where the two do not overlap.
void move_bytes(void* to, const void* from, size_t bytes);

}  // namespace unison
