// Fuzz target: the manifest parser on arbitrary bytes.
//
// A rejection must be a Corruption naming the file in one short, printable
// line (never the "unexpected JSON error" that ParseManifest keeps for bugs).
// An accepted manifest must only name shards that are plain files in the
// checkpoint directory, and place every tensor inside its shard without
// overflow; SerializeManifest of it must parse back to an equal manifest
// (and serialize to the same text again).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "base/dtype.h"
#include "format/manifest.h"
#include "format/validate.h"
#include "fuzz_check.h"

namespace ckptio::fuzz {
namespace {

using format::Manifest;
using format::ManifestShard;
using format::ManifestTensor;

constexpr std::string_view kFile = "fuzz/manifest.json";
constexpr size_t kMaxMessageBytes = 2048;

void CheckRejection(const Status& s) {
  FUZZ_CHECK(s.code() == StatusCode::kCorruption, s.ToString().substr(0, 500));
  FUZZ_CHECK(s.message().starts_with(std::string(kFile) + ": "), s.message().substr(0, 300));
  FUZZ_CHECK(s.message().size() <= kMaxMessageBytes, s.message().substr(0, 300));
  for (char c : s.message()) {
    FUZZ_CHECK(static_cast<unsigned char>(c) >= 0x20, s.message().substr(0, 300));
  }
}

bool IsShardNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-';
}

void CheckManifest(const Manifest& m) {
  FUZZ_CHECK(m.format_version >= format::kManifestFormatVersion && m.format_version <= format::kLatestFormatVersion,
             "format_version");
  FUZZ_CHECK(m.step >= 0, std::to_string(m.step));
  FUZZ_CHECK(m.metadata.is_object(), "metadata");
  FUZZ_CHECK(format::IsRfc3339Utc(m.created), m.created);
  std::unordered_set<std::string> shard_names;
  for (const ManifestShard& s : m.shards) {
    const std::string what = "shard " + format::Quoted(s.name);
    // Joined to the checkpoint directory or the bucket prefix, a shard name
    // must stay a single file in it.
    FUZZ_CHECK(IsPlainFileName(s.name), what);
    FUZZ_CHECK(s.name.size() <= 255, what);
    for (char c : s.name) FUZZ_CHECK(IsShardNameChar(c), what);
    FUZZ_CHECK(shard_names.insert(s.name).second, what + " twice");
    FUZZ_CHECK(s.bytes <= format::kMaxShardBytes, what);
  }
  std::unordered_set<std::string> tensor_names;
  for (const ManifestTensor& t : m.tensors) {
    const std::string what = "tensor " + format::Quoted(t.name);
    FUZZ_CHECK(tensor_names.insert(t.name).second, what + " twice");
    FUZZ_CHECK(IsConfinedRelativePath(t.name), what);
    FUZZ_CHECK(format::IsValidUtf8(t.name), what);
    FUZZ_CHECK(t.shard < m.shards.size(), what);
    const ManifestShard& shard = m.shards[t.shard];
    uint64_t end = 0;
    FUZZ_CHECK(!__builtin_add_overflow(t.offset, t.bytes, &end), what);
    FUZZ_CHECK(end <= shard.bytes, what + " ends at " + std::to_string(end) + " past shard " +
                                       std::to_string(shard.bytes));
    auto bytes = base::TensorBytes(t.dtype, t.shape);
    FUZZ_CHECK_OK(bytes, what);
    FUZZ_CHECK(*bytes == t.bytes, what);
  }
  FUZZ_CHECK_OK(format::ValidateManifest(kFile, m), "ValidateManifest of a parsed manifest");
}

void CheckSameManifest(const Manifest& a, const Manifest& b) {
  FUZZ_CHECK(a.format_version == b.format_version && a.step == b.step &&
                 a.created == b.created && a.writer == b.writer,
             "top-level fields differ after a round trip");
  FUZZ_CHECK(a.metadata == b.metadata, "metadata differs after a round trip: " +
                                           a.metadata.dump(-1, ' ', true).substr(0, 300));
  FUZZ_CHECK(a.shards.size() == b.shards.size(), "shard count differs after a round trip");
  for (size_t i = 0; i < a.shards.size(); ++i) {
    const ManifestShard& x = a.shards[i];
    const ManifestShard& y = b.shards[i];
    FUZZ_CHECK(x.name == y.name && x.bytes == y.bytes && x.crc32c == y.crc32c,
               "shard " + std::to_string(i) + " differs after a round trip");
  }
  FUZZ_CHECK(a.tensors.size() == b.tensors.size(), "tensor count differs after a round trip");
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const ManifestTensor& x = a.tensors[i];
    const ManifestTensor& y = b.tensors[i];
    FUZZ_CHECK(x.name == y.name && x.dtype == y.dtype && x.shape == y.shape &&
                   x.shard == y.shard && x.offset == y.offset && x.bytes == y.bytes &&
                   x.crc32c == y.crc32c && x.chunk.array == y.chunk.array &&
                   x.chunk.global_shape == y.chunk.global_shape && x.chunk.start == y.chunk.start,
               "tensor " + std::to_string(i) + " differs after a round trip");
  }
}

}  // namespace
}  // namespace ckptio::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptio;
  using namespace ckptio::fuzz;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto m = format::ParseManifest(kFile, bytes);
  if (!m.ok()) {
    CheckRejection(m.status());
    return 0;
  }
  CheckManifest(*m);
  const std::string text = format::SerializeManifest(*m);
  auto again = format::ParseManifest(kFile, text);
  FUZZ_CHECK_OK(again, "the serialized manifest");
  CheckManifest(*again);
  CheckSameManifest(*m, *again);
  FUZZ_CHECK(format::SerializeManifest(*again) == text, "serializing is not stable");
  return 0;
}
