// SHA-256 and HMAC-SHA-256 (native/tcp/sha256.cc) against published
// known answers: the FIPS 180-2 examples, RFC 4231's seven HMAC cases, and
// Python's hashlib and hmac at every length across the padding boundaries.
#define UNIT_FILE "sha256"
#include <string>

#include "tcp/sha256.h"
#include "unit.h"

namespace {

std::string hex(const unison::Digest& d, size_t bytes = 32) {
  static const char* const kDigits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) out += std::string{kDigits[d[i] >> 4], kDigits[d[i] & 15]};
  return out;
}

std::string of(const std::string& message) { return hex(unison::sha256(message.data(), message.size())); }

std::string hmac(const std::string& key, const std::string& message, size_t bytes = 32) {
  return hex(unison::hmac_sha256(key, message.data(), message.size()), bytes);
}

std::string repeat(char byte, size_t count) { return std::string(count, byte); }

}  // namespace

UNIT_TEST(fips_180_2_examples) {
  EXPECT_EQ(of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 56 bytes: the length no longer fits in the first block's padding.
  EXPECT_EQ(of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(of("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrst"
               "nopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(of(repeat('a', 1000000)), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

UNIT_TEST(rfc_4231_hmac_cases) {
  std::string counting;
  for (char c = 1; c <= 25; ++c) counting += c;
  EXPECT_EQ(hmac(repeat('\x0b', 20), "Hi There"), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hmac("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hmac(repeat('\xaa', 20), repeat('\xdd', 50)),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(hmac(counting, repeat('\xcd', 50)), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Case 5 compares the first 128 bits only.
  EXPECT_EQ(hmac(repeat('\x0c', 20), "Test With Truncation", 16), "a3b6167473100ee06e0c796c2955552b");
  // Keys longer than the 64-byte block are hashed first.
  EXPECT_EQ(hmac(repeat('\xaa', 131), "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(hmac(repeat('\xaa', 131),
                 "This is a test using a larger than block-size key and a larger than block-size data. The key needs "
                 "to be hashed before being used by the HMAC algorithm."),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

UNIT_TEST(keys_up_to_one_block_are_used_as_they_are_and_longer_ones_hashed) {
  EXPECT_EQ(hmac(repeat('k', 64), "message"), "890f3a16e0ca0aaa3bf180f70fa8e3970b3fd6505e98fde157988dcc19d1685c");
  EXPECT_EQ(hmac(repeat('k', 65), "message"), "0c256505306af48015530c139bb7add5ad7a6a9291cd511278a067e765816fbd");
}

// Every length from 0 to 256 bytes, so every padding boundary of the
// 64-byte block (55/56, 63/64/65, and so on for four blocks): the digests
// of the first n bytes of one message, themselves hashed together. The
// expected value is Python's hashlib and hmac on the same bytes.
static std::string pattern(size_t bytes) {
  std::string out;
  for (size_t i = 0; i < bytes; ++i) out += (char)((i * 7 + 3) & 0xff);
  return out;
}

UNIT_TEST(every_length_across_four_blocks_matches_hashlib) {
  const std::string message = pattern(300);
  std::string digests, proofs;
  for (size_t n = 0; n <= 256; ++n) {
    const unison::Digest d = unison::sha256(message.data(), n);
    digests.append(d.begin(), d.end());
    const unison::Digest p = unison::hmac_sha256(message.substr(0, n), message.data(), n / 2);
    proofs.append(p.begin(), p.end());
  }
  EXPECT_EQ(of(digests), "a2ffce5711a9abde1c229b9d0d1aabc85d4ab792e68b482ed48061854426f40a");
  EXPECT_EQ(of(proofs), "56d829aa1f207a823f2611577ba06e05c0fe6bad35b58703e165018fee27469e");
}

UNIT_TEST(equal_in_constant_time_compares_every_byte) {
  unison::Digest a = unison::sha256("x", 1), b = a;
  EXPECT(unison::equal_in_constant_time(a, b));
  for (size_t i : {0, 17, 31}) {
    b = a;
    b[i] ^= 1;
    EXPECT(!unison::equal_in_constant_time(a, b));
  }
}
