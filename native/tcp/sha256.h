// sha256.h: SHA-256 and HMAC-SHA-256, for authenticating connections with
// the job's secret (FIPS 180-4, RFC 2104). Written here so that the core
// needs no crypto library; nothing is encrypted, only proven.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace unison {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t bytes);
Digest hmac_sha256(const std::string& key, const void* data, size_t bytes);

// Compares in time that does not depend on where they first differ, so a
// peer cannot learn a valid proof byte by byte from how long a refusal takes.
bool equal_in_constant_time(const Digest& a, const Digest& b);

}  // namespace unison
