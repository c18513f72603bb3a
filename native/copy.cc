// copy.cc: memcpy that steps around `rep movsb`'s slow distances (copy.h).
#include "copy.h"

#include <cstdint>
#include <cstring>

#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace unison {
namespace {

// Below glibc's `rep movsb` threshold (2112 bytes here) memcpy takes vector
// loops at every distance.
constexpr size_t kSmallestAffected = 2048;

// Above this, glibc stops using `rep movsb`: on AMD CPUs at the L2 cache's
// size (1 MiB on this project's VMs; copies of 1.2 MB and up ran at full
// speed at every distance). There memcpy's own loops beat copy_by_vectors
// by a fifth at odd distances, so copy_bytes leaves them to it.
size_t largest_affected() {
  static const size_t largest = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<size_t>(l2) : size_t{1} << 20;
  }();
  return largest;
}

bool slow_distance(const void* to, const void* from) {
  const uintptr_t distance = ((uintptr_t)to - (uintptr_t)from) & 4095;
  return distance != 0 && distance < 64;
}

#if defined(__x86_64__)
// Four loads, then four stores: a load never waits on the store just
// before it, which is what makes the short distance slow for `rep movsb`.
// Not written as a plain loop of assignments, which the compiler may turn
// back into a call to memcpy.
void copy_by_vectors(char* to, const char* from, size_t bytes) {
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
  }
  std::memcpy(to + i, from + i, bytes - i);  // the tail under 64 bytes
}
#else
void copy_by_vectors(char* to, const char* from, size_t bytes) { std::memcpy(to, from, bytes); }
#endif

}  // namespace

void copy_bytes(void* to, const void* from, size_t bytes) {
  if (bytes == 0) return;  // an empty tensor's pointers may be null, which memcpy may not be given
  if (bytes < kSmallestAffected || bytes > largest_affected() || !slow_distance(to, from)) {
    std::memcpy(to, from, bytes);
    return;
  }
  copy_by_vectors(static_cast<char*>(to), static_cast<const char*>(from), bytes);
}

void move_bytes(void* to, const void* from, size_t bytes) {
  if (bytes == 0) return;
  const char* a = static_cast<const char*>(to);
  const char* b = static_cast<const char*>(from);
  if (a < b + bytes && b < a + bytes) {
    std::memmove(to, from, bytes);
    return;
  }
  copy_bytes(to, from, bytes);
}

}  // namespace unison
