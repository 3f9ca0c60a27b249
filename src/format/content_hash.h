#pragma once
// The content hash of a tensor: how an incremental save tells that a tensor's
// bytes did not change since the last committed step (CRC32C alone cannot:
// 32 bits collide after ~2^16 tensors). XXH3-128 (xxHash 0.8, Debian's
// libxxhash-dev, used header-only), with an AVX2 path picked at run time.
//
// Defined piecewise so that pieces can be hashed in parallel, in the pass
// that computes the CRC32C: a tensor's hash is XXH3-128 over the canonical
// (big-endian, 16-byte) XXH3-128 digests of its consecutive kHashPiece-byte
// pieces (the last one shorter; a zero-byte tensor has no pieces, so its hash
// is XXH3-128 of nothing). The piece size is part of the format.
// All functions are pure and thread-safe.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ckptio/status.h"

namespace ckptio::format {

inline constexpr size_t kHashPiece = size_t{8} << 20;  // 8 MiB

struct Hash128 {
  uint64_t high = 0;
  uint64_t low = 0;
  friend bool operator==(const Hash128&, const Hash128&) = default;
};

// XXH3-128 of n bytes.
Hash128 Xxh3(const void* data, size_t n);

// A tensor's hash from the hashes of its pieces, in order.
Hash128 CombinePieceHashes(std::span<const Hash128> pieces);

// The hash of a whole tensor held in memory (pieces as defined above): the
// reference the save path (pieces hashed by the pool) is tested against.
Hash128 ContentHash(const void* data, size_t n);

// The manifest spelling: 32 lowercase hex digits, high half first.
std::string HashToHex(const Hash128& h);
// The inverse; InvalidArgument unless `text` is exactly 32 hex digits.
Result<Hash128> HashFromHex(std::string_view text);

}  // namespace ckptio::format
