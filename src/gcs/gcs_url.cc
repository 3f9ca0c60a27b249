#include "gcs/gcs_url.h"

#include <cctype>

namespace ckptio::gcs {

Result<GcsPath> ParseGcsUrl(std::string_view url) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError("bad GCS URL \"" + std::string(url) + "\": " + std::string(why));
  };
  if (url.rfind("gs://", 0) != 0) return bad("it must start with gs://");
  std::string_view rest = url.substr(5);
  size_t slash = rest.find('/');
  GcsPath p;
  p.bucket = std::string(rest.substr(0, slash));
  if (p.bucket.size() < 3 || p.bucket.size() > 222) return bad("bucket names have 3 to 222 characters");
  for (char c : p.bucket) {
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '-' ||
          c == '_' || c == '.')) {
      return bad("bucket names use only a-z, 0-9, '-', '_' and '.'");
    }
  }
  std::string_view prefix = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.remove_suffix(1);
  // Reject empty, "." and ".." segments: a prefix names one place.
  size_t start = 0;
  while (start < prefix.size()) {
    size_t end = prefix.find('/', start);
    if (end == std::string_view::npos) end = prefix.size();
    std::string_view seg = prefix.substr(start, end - start);
    if (seg.empty() || seg == "." || seg == "..") return bad("empty, \".\" or \"..\" path segment");
    start = end + 1;
  }
  p.prefix = std::string(prefix);
  return p;
}

std::string UrlEncode(std::string_view s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3);
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace ckptio::gcs
