#include "base/text.h"

#include <cstdint>
#include <nlohmann/json.hpp>

namespace ckptio::base {
namespace {

constexpr size_t kMaxQuotedBytes = 120;

// Length of the UTF-8 sequence starting at s[i], or 0 if it is malformed.
size_t Utf8SequenceLength(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t len = 0;
  uint32_t cp = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2;
    cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3;
    cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4;
    cp = b0 & 0x07;
  } else {
    return 0;
  }
  if (s.size() - i < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[len]) return 0;              // overlong
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;          // surrogate
  if (cp > 0x10FFFF) return 0;
  return len;
}

}  // namespace

std::string Quoted(std::string_view s) {
  const bool cut = s.size() > kMaxQuotedBytes;
  nlohmann::json j = std::string(s.substr(0, kMaxQuotedBytes));
  std::string out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (cut) out += "...";
  return out;
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8SequenceLength(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

}  // namespace ckptio::base
