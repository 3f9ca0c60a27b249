#include "format/content_hash.h"

#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ckptio::format {
// content_hash_avx2.cc: the same function compiled with -mavx2.
Hash128 Xxh3Avx2(const void* data, size_t n);

namespace {
Hash128 Xxh3Portable(const void* data, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(data, n);
  return {h.high64, h.low64};
}

using HashFn = Hash128 (*)(const void*, size_t);
HashFn PickHash() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? &Xxh3Avx2 : &Xxh3Portable;
}
const HashFn kHash = PickHash();

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

Hash128 Xxh3(const void* data, size_t n) { return kHash(data, n); }

Hash128 CombinePieceHashes(std::span<const Hash128> pieces) {
  std::vector<unsigned char> canonical(pieces.size() * 16);
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (int b = 0; b < 8; ++b) {
      canonical[i * 16 + b] = static_cast<unsigned char>(pieces[i].high >> (56 - 8 * b));
      canonical[i * 16 + 8 + b] = static_cast<unsigned char>(pieces[i].low >> (56 - 8 * b));
    }
  }
  return Xxh3(canonical.data(), canonical.size());
}

Hash128 ContentHash(const void* data, size_t n) {
  std::vector<Hash128> pieces;
  const char* p = static_cast<const char*>(data);
  for (size_t off = 0; off < n; off += kHashPiece) pieces.push_back(Xxh3(p + off, std::min(kHashPiece, n - off)));
  return CombinePieceHashes(pieces);
}

std::string HashToHex(const Hash128& h) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[i] = kHex[(h.high >> (60 - 4 * i)) & 15];
    out[16 + i] = kHex[(h.low >> (60 - 4 * i)) & 15];
  }
  return out;
}

Result<Hash128> HashFromHex(std::string_view text) {
  if (text.size() != 32) return InvalidArgumentError("content hash \"" + std::string(text.substr(0, 40)) + "\" is not 32 hex digits");
  Hash128 h;
  for (size_t i = 0; i < 32; ++i) {
    const int d = HexDigit(text[i]);
    if (d < 0) return InvalidArgumentError("content hash \"" + std::string(text) + "\" is not 32 hex digits");
    uint64_t& half = i < 16 ? h.high : h.low;
    half = half << 4 | static_cast<uint64_t>(d);
  }
  return h;
}

}  // namespace ckptio::format
