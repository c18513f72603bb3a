#include "sha256.h"

#include <cstring>
#include <vector>

namespace unison {
namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotate_right(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t state[8], const uint8_t block[64]) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 | (uint32_t)block[4 * i + 2] << 8 |
           (uint32_t)block[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotate_right(w[i - 15], 7) ^ rotate_right(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotate_right(w[i - 2], 17) ^ rotate_right(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3], e = state[4], f = state[5], g = state[6],
           h = state[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotate_right(e, 6) ^ rotate_right(e, 11) ^ rotate_right(e, 25)) + ((e & f) ^ (~e & g)) +
                        kRoundConstants[i] + w[i];
    const uint32_t t2 = (rotate_right(a, 2) ^ rotate_right(a, 13) ^ rotate_right(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  state[0] += a, state[1] += b, state[2] += c, state[3] += d;
  state[4] += e, state[5] += f, state[6] += g, state[7] += h;
}

}  // namespace

Digest sha256(const void* data, size_t bytes) {
  uint32_t state[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const uint8_t* in = static_cast<const uint8_t*>(data);
  size_t whole = bytes / 64 * 64;
  for (size_t at = 0; at < whole; at += 64) compress(state, in + at);
  // The tail, a 1 bit, zeros, and the length in bits: one or two blocks.
  uint8_t tail[128] = {0};
  const size_t rest = bytes - whole;
  if (rest > 0) std::memcpy(tail, in + whole, rest);
  tail[rest] = 0x80;
  const size_t blocks = rest + 1 + 8 <= 64 ? 1 : 2;
  const uint64_t bits = (uint64_t)bytes * 8;
  for (int i = 0; i < 8; ++i) tail[blocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
  for (size_t b = 0; b < blocks; ++b) compress(state, tail + 64 * b);
  Digest out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = (uint8_t)(state[i] >> (24 - 8 * j));
  return out;
}

Digest hmac_sha256(const std::string& key, const void* data, size_t bytes) {
  uint8_t block_key[64] = {0};
  if (key.size() > 64) {
    const Digest d = sha256(key.data(), key.size());
    std::memcpy(block_key, d.data(), d.size());
  } else {
    std::memcpy(block_key, key.data(), key.size());
  }
  std::vector<uint8_t> inner(64 + bytes);
  for (int i = 0; i < 64; ++i) inner[i] = block_key[i] ^ 0x36;
  if (bytes > 0) std::memcpy(inner.data() + 64, data, bytes);
  const Digest inner_digest = sha256(inner.data(), inner.size());
  uint8_t outer[64 + 32];
  for (int i = 0; i < 64; ++i) outer[i] = block_key[i] ^ 0x5c;
  std::memcpy(outer + 64, inner_digest.data(), 32);
  return sha256(outer, sizeof(outer));
}

bool equal_in_constant_time(const Digest& a, const Digest& b) {
  uint8_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ |= a[i] ^ b[i];
  return differ == 0;
}

}  // namespace unison
