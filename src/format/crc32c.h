#pragma once
// CRC32C (Castagnoli), the checksum GCS uses and ckptio keeps for every tensor
// and shard. The bulk work runs on ISA-L (SSE4.2 / PCLMUL / AVX-512 paths);
// Crc32cCombine merges CRCs of chunks computed in parallel, so a shard's CRC
// never needs a second pass over its bytes.
// All functions are pure and thread-safe.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ckptio/status.h"

namespace ckptio::format {

// The standard CRC32C of n bytes: Crc32c("123456789", 9) == 0xE3069283.
uint32_t Crc32c(const void* data, size_t n);

// Continues a CRC: Crc32cExtend(Crc32c(a), b) == Crc32c(a + b), and
// Crc32cExtend(0, a) == Crc32c(a).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

// The CRC of a + b given crc_a = Crc32c(a), crc_b = Crc32c(b) and b's length,
// in O(log len_b) time without touching the data.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// GCS spelling (x-goog-hash: crc32c=..., object metadata "crc32c"): base64 of
// the 4 big-endian bytes, e.g. 0xE3069283 -> "4waSgw==".
std::string Crc32cToBase64(uint32_t crc);
// The inverse; InvalidArgument unless `text` is exactly 8 canonical base64
// characters ending in "==".
Result<uint32_t> Crc32cFromBase64(std::string_view text);

// The manifest spelling: 8 lowercase hex digits, e.g. "e3069283".
std::string Crc32cToHex(uint32_t crc);
// The inverse; InvalidArgument unless `text` is exactly 8 hex digits (either case).
Result<uint32_t> Crc32cFromHex(std::string_view text);

}  // namespace ckptio::format
