// Fuzz target: the safetensors header parser on arbitrary bytes.
//
// The input is a whole safetensors file: ParseHeaderLength reads N from its
// first 8 bytes, ParseSafetensorsHeader parses the next N, and the file size
// is the input's size (the data section is whatever follows; the parser never
// reads it). A rejection must be a Corruption naming the file in one short,
// printable line. An accepted header must obey the format's rules; and what
// BuildSafetensorsPrefix writes for it must parse back to the same header.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_set>

#include "base/dtype.h"
#include "format/safetensors.h"
#include "format/validate.h"
#include "fuzz_check.h"

namespace ckptio::fuzz {
namespace {

using format::SafetensorsHeader;
using format::TensorEntry;

constexpr std::string_view kFile = "fuzz.safetensors";
// Error messages quote at most 120 bytes of a name and 16 dimensions of a
// shape; anything near this long means hostile input leaks into a log line.
constexpr size_t kMaxMessageBytes = 2048;

std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

void CheckRejection(const Status& s) {
  FUZZ_CHECK(s.code() == StatusCode::kCorruption, s.ToString());
  FUZZ_CHECK(s.message().starts_with(std::string(kFile) + ": "), s.message());
  FUZZ_CHECK(s.message().size() <= kMaxMessageBytes, s.message().substr(0, 300));
  for (char c : s.message()) {
    FUZZ_CHECK(static_cast<unsigned char>(c) >= 0x20, s.message().substr(0, 300));
  }
}

// The rules of the format, checked on what the parser accepted.
void CheckHeader(const SafetensorsHeader& h, uint64_t header_bytes, uint64_t file_size) {
  FUZZ_CHECK(h.data_start == 8 + header_bytes, std::to_string(h.data_start));
  FUZZ_CHECK(h.data_start <= file_size, std::to_string(h.data_start));
  const uint64_t data_size = file_size - h.data_start;
  std::unordered_set<std::string> names;
  uint64_t covered = 0;
  for (const TensorEntry& t : h.tensors) {
    const std::string what = "tensor " + format::Quoted(t.name);
    FUZZ_CHECK(names.insert(t.name).second, what + " twice");
    FUZZ_CHECK(IsConfinedRelativePath(t.name), what);
    FUZZ_CHECK(t.name != "__metadata__", what);
    FUZZ_CHECK(format::IsValidUtf8(t.name), what);
    FUZZ_CHECK_OK(format::CheckTensorName(t.name), what);
    FUZZ_CHECK(base::DTypeSize(t.dtype) != 0, what);
    // The bytes [data_start + begin, data_start + end) lie inside the file.
    FUZZ_CHECK(t.begin <= t.end && t.end <= data_size, what);
    uint64_t abs_end = 0;
    FUZZ_CHECK(!__builtin_add_overflow(h.data_start, t.end, &abs_end) && abs_end <= file_size,
               what);
    auto bytes = base::TensorBytes(t.dtype, t.shape);
    FUZZ_CHECK_OK(bytes, what);
    FUZZ_CHECK(*bytes == t.end - t.begin, what);
    // Sorted by begin and tiling the data section: no hole, no overlap.
    FUZZ_CHECK(t.begin == covered, what + " begins at " + std::to_string(t.begin) +
                                       ", expected " + std::to_string(covered));
    covered = t.end;
  }
  FUZZ_CHECK(covered == data_size, "tensors cover " + std::to_string(covered) + " of " +
                                       std::to_string(data_size) + " bytes");
  for (const auto& [key, value] : h.metadata) {
    FUZZ_CHECK(format::IsValidUtf8(key) && format::IsValidUtf8(value), format::Quoted(key));
  }
}

// Tensors keyed by name: the order of zero-byte tensors at one offset is not
// part of the format.
std::map<std::string, const TensorEntry*> ByName(const SafetensorsHeader& h) {
  std::map<std::string, const TensorEntry*> out;
  for (const TensorEntry& t : h.tensors) out.emplace(t.name, &t);
  return out;
}

void CheckSameHeader(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  FUZZ_CHECK(a.metadata == b.metadata, "metadata differs after a round trip");
  const auto x = ByName(a);
  const auto y = ByName(b);
  FUZZ_CHECK(x.size() == y.size(), "tensor count differs after a round trip");
  for (auto i = x.begin(), j = y.begin(); i != x.end(); ++i, ++j) {
    const TensorEntry& s = *i->second;
    const TensorEntry& t = *j->second;
    FUZZ_CHECK(s.name == t.name && s.dtype == t.dtype && s.shape == t.shape &&
                   s.begin == t.begin && s.end == t.end,
               "tensor " + format::Quoted(s.name) + " differs after a round trip");
  }
}

// What ckptio would write for this header parses back to the same header,
// padded (align 4096, as for O_DIRECT) or not.
void CheckRoundTrip(const SafetensorsHeader& h, uint64_t data_size) {
  for (size_t align : {size_t{1}, size_t{4096}}) {
    const std::string prefix = format::BuildSafetensorsPrefix(h.tensors, h.metadata, align);
    FUZZ_CHECK(prefix.size() % align == 0, std::to_string(prefix.size()));
    const uint64_t file_size = prefix.size() + data_size;
    auto n = format::ParseHeaderLength(kFile, AsBytes(prefix).first(8), file_size);
    FUZZ_CHECK_OK(n, "length of a rebuilt header");
    FUZZ_CHECK(*n + 8 == prefix.size(), std::to_string(*n));
    auto again = format::ParseSafetensorsHeader(kFile, AsBytes(prefix).subspan(8), file_size);
    FUZZ_CHECK_OK(again, "a rebuilt header");
    CheckHeader(*again, *n, file_size);
    CheckSameHeader(h, *again);
  }
}

}  // namespace
}  // namespace ckptio::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptio;
  using namespace ckptio::fuzz;
  const std::span<const uint8_t> file(data, size);
  const uint64_t file_size = size;
  auto n = format::ParseHeaderLength(kFile, file.first(std::min<size_t>(8, size)), file_size);
  if (!n.ok()) {
    CheckRejection(n.status());
    return 0;
  }
  FUZZ_CHECK(*n <= format::kMaxHeaderBytes && 8 + *n <= file_size, std::to_string(*n));
  auto header = format::ParseSafetensorsHeader(kFile, file.subspan(8, *n), file_size);
  if (!header.ok()) {
    CheckRejection(header.status());
    return 0;
  }
  CheckHeader(*header, *n, file_size);
  CheckRoundTrip(*header, file_size - header->data_start);
  return 0;
}
