#include "format/crc32c.h"

#include <isa-l/crc.h>

#include "format/validate.h"

namespace ckptio::format {
namespace {

// ISA-L takes an int length; stay well below INT_MAX.
constexpr size_t kMaxIsalChunk = size_t{1} << 30;

// The Castagnoli polynomial, bit-reflected (bit 31 is the x^0 coefficient).
constexpr uint32_t kReflectedPoly = 0x82F63B78;

// a * b mod P in the reflected representation (zlib's multmodp).
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = uint32_t{1} << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kReflectedPoly : b >> 1;
  }
  return product;
}

// x^(8 * n) mod P: the operator that appends n zero bytes to a CRC register,
// by square-and-multiply over the bits of n.
uint32_t AppendZerosOperator(uint64_t n) {
  uint32_t result = uint32_t{1} << 31;  // x^0
  uint32_t square = uint32_t{1} << (31 - 8);  // x^8: one zero byte
  for (; n != 0; n >>= 1) {
    if (n & 1) result = MultiplyModP(result, square);
    square = MultiplyModP(square, square);
  }
  return result;
}

constexpr char kBase64Alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int Base64Value(char c) {
  for (int i = 0; i < 64; ++i) {
    if (kBase64Alphabet[i] == c) return i;
  }
  return -1;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  // ISA-L's crc32_iscsi neither pre- nor post-inverts: it runs the register
  // from init_crc. The standard CRC32C starts the register at ~0 and inverts
  // at the end, so undo the final inversion of `crc` to resume from it.
  uint32_t reg = ~crc;
  auto* bytes = static_cast<unsigned char*>(const_cast<void*>(data));
  while (n > 0) {
    const size_t chunk = n < kMaxIsalChunk ? n : kMaxIsalChunk;
    reg = crc32_iscsi(bytes, static_cast<int>(chunk), reg);
    bytes += chunk;
    n -= chunk;
  }
  return ~reg;
}

uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // CRC is affine over GF(2): crc(a + b) = crc(a) * x^(8 len_b) ^ crc(b), the
  // pre- and post-inversions cancelling out as in zlib's crc32_combine.
  return MultiplyModP(AppendZerosOperator(len_b), crc_a) ^ crc_b;
}

std::string Crc32cToBase64(uint32_t crc) {
  // 32 bits = five full sextets and 2 bits; the last sextet is zero-padded.
  std::string out;
  for (int shift = 26; shift >= 2; shift -= 6) out += kBase64Alphabet[(crc >> shift) & 0x3F];
  out += kBase64Alphabet[(crc & 0x3) << 4];
  out += "==";
  return out;
}

Result<uint32_t> Crc32cFromBase64(std::string_view text) {
  const auto invalid = [&] {
    return InvalidArgumentError("CRC32C " + Quoted(text) + " is not 8 characters of base64");
  };
  if (text.size() != 8 || text.substr(6) != "==") return invalid();
  uint64_t bits = 0;
  for (char c : text.substr(0, 6)) {
    const int v = Base64Value(c);
    if (v < 0) return invalid();
    bits = (bits << 6) | static_cast<uint64_t>(v);
  }
  // 36 bits decoded; the low 4 are padding and must be zero (canonical form).
  if ((bits & 0xF) != 0) return invalid();
  return static_cast<uint32_t>(bits >> 4);
}

std::string Crc32cToHex(uint32_t crc) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) out[static_cast<size_t>(i)] = kDigits[crc & 0xF];
  return out;
}

Result<uint32_t> Crc32cFromHex(std::string_view text) {
  const auto invalid = [&] {
    return InvalidArgumentError("CRC32C " + Quoted(text) + " is not 8 hex digits");
  };
  if (text.size() != 8) return invalid();
  uint32_t crc = 0;
  for (char c : text) {
    const int v = HexValue(c);
    if (v < 0) return invalid();
    crc = (crc << 4) | static_cast<uint32_t>(v);
  }
  return crc;
}

}  // namespace ckptio::format
