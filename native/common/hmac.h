// SHA-256 and HMAC-SHA256, self-contained so the core needs no crypto library installed.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace shvd {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const std::string& key, const void* data, size_t n);
// Constant-time comparison.
bool digest_equal(const Digest& a, const Digest& b);
// Fills `n` bytes from /dev/urandom.
void random_bytes(void* out, size_t n);

}  // namespace shvd
