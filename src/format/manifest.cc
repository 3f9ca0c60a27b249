#include "format/manifest.h"

#include <time.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "format/json_reader.h"
#include "format/validate.h"

namespace ckptio::format {
namespace {

// ---- Serializing ----------------------------------------------------------

std::string Compact(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Json ShardJson(const ManifestShard& s) {
  Json j;  // keys sort as bytes, crc32c, name: fine for a one-line object
  j["name"] = s.Path();
  j["bytes"] = s.bytes;
  j["crc32c"] = Crc32cToHex(s.crc32c);
  return j;
}

Json TensorJson(const ManifestTensor& t, const std::vector<ManifestShard>& shards) {
  Json j;
  j["name"] = t.name;
  j["dtype"] = std::string(base::DTypeName(t.dtype));
  j["shape"] = t.shape;
  j["shard"] = t.shard < shards.size() ? shards[t.shard].Path() : std::string();
  j["offset"] = t.offset;
  j["bytes"] = t.bytes;
  j["crc32c"] = Crc32cToHex(t.crc32c);
  if (!t.chunk.empty()) {
    j["array"] = t.chunk.array;
    j["global_shape"] = t.chunk.global_shape;
    j["start"] = t.chunk.start;
  }
  if (t.xxh3) j["xxh3"] = HashToHex(*t.xxh3);
  return j;
}

// `"key": [` then one compact element per line.
template <typename T, typename ToJson>
void AppendArray(std::string& out, std::string_view key, const std::vector<T>& items,
                 ToJson to_json) {
  out += "  \"" + std::string(key) + "\": [";
  for (size_t i = 0; i < items.size(); ++i) {
    out += i == 0 ? "\n    " : ",\n    ";
    out += Compact(to_json(items[i]));
  }
  out += items.empty() ? "]" : "\n  ]";
}

// ---- Parsing --------------------------------------------------------------

Result<uint32_t> ReadCrc(const FieldReader& r) {
  ASSIGN_OR_RETURN(std::string text, r.String("crc32c"));
  auto crc = Crc32cFromHex(text);
  if (!crc.ok()) return AsCorruption(r.context(), crc.status());
  return *crc;
}

// The "name" of the i-th element of `list`, read before the element can be
// named in messages by it.
Result<std::string> ReadName(std::string_view file, std::string_view list, size_t i,
                             const Json& j) {
  const std::string context = std::string(file) + ": " + std::string(list) + "[" +
                              std::to_string(i) + "]";
  if (!j.is_object()) return CorruptionError(context + " is not a JSON object");
  return FieldReader(context, j).String("name");
}

Result<ManifestShard> ParseShard(std::string_view file, size_t i, const Json& j, int version) {
  ManifestShard s;
  ASSIGN_OR_RETURN(s.name, ReadName(file, "shards", i, j));
  const FieldReader r(std::string(file) + ": shard " + Quoted(s.name), j);
  // "checkpoint_100/shard-00000.safetensors": a file of an earlier checkpoint
  // (both parts are checked as plain names by CheckShards).
  if (const size_t slash = s.name.find('/'); version >= kIncrementalFormatVersion && slash != std::string::npos) {
    s.checkpoint = s.name.substr(0, slash);
    s.name.erase(0, slash + 1);
  }
  RETURN_IF_ERROR(r.CheckKeys({"name", "bytes", "crc32c"}));
  ASSIGN_OR_RETURN(s.bytes, r.U64("bytes"));
  ASSIGN_OR_RETURN(s.crc32c, ReadCrc(r));
  return s;
}

using ShardIndex = std::unordered_map<std::string, uint32_t>;

Result<ManifestTensor> ParseTensor(std::string_view file, size_t i, const Json& j,
                                   const ShardIndex& shard_index, int version) {
  ManifestTensor t;
  ASSIGN_OR_RETURN(t.name, ReadName(file, "tensors", i, j));
  const FieldReader r(std::string(file) + ": tensor " + Quoted(t.name), j);
  std::vector<std::string_view> keys = {"name", "dtype", "shape", "shard", "offset", "bytes", "crc32c"};
  if (version >= kIncrementalFormatVersion && j.contains("xxh3")) {
    keys.push_back("xxh3");
    ASSIGN_OR_RETURN(std::string hex, r.String("xxh3"));
    auto hash = HashFromHex(hex);
    if (!hash.ok()) return AsCorruption(r.context(), hash.status());
    t.xxh3 = *hash;
  }
  if (version >= kChunkedFormatVersion && j.contains("array")) {
    keys.insert(keys.end(), {"array", "global_shape", "start"});
    RETURN_IF_ERROR(r.CheckKeys(keys));
    ASSIGN_OR_RETURN(t.chunk.array, r.String("array"));
    ASSIGN_OR_RETURN(t.chunk.global_shape, r.U64Array("global_shape"));
    ASSIGN_OR_RETURN(t.chunk.start, r.U64Array("start"));
    if (t.chunk.array.empty()) return r.Error("field \"array\" is empty");
  } else {
    RETURN_IF_ERROR(r.CheckKeys(keys));
  }
  ASSIGN_OR_RETURN(std::string dtype, r.String("dtype"));
  auto parsed_dtype = base::ParseDType(dtype);
  if (!parsed_dtype.ok()) return AsCorruption(r.context(), parsed_dtype.status());
  t.dtype = *parsed_dtype;
  ASSIGN_OR_RETURN(t.shape, r.U64Array("shape"));
  ASSIGN_OR_RETURN(std::string shard, r.String("shard"));
  auto it = shard_index.find(shard);
  if (it == shard_index.end()) {
    return r.Error("names shard " + Quoted(shard) + ", which the manifest does not list");
  }
  t.shard = it->second;
  ASSIGN_OR_RETURN(t.offset, r.U64("offset"));
  ASSIGN_OR_RETURN(t.bytes, r.U64("bytes"));
  ASSIGN_OR_RETURN(t.crc32c, ReadCrc(r));
  return t;
}

Status ParseShards(std::string_view file, const Json& list, Manifest& m, ShardIndex& index) {
  for (size_t i = 0; i < list.size(); ++i) {
    ASSIGN_OR_RETURN(ManifestShard shard, ParseShard(file, i, list[i], m.format_version));
    if (!index.emplace(shard.Path(), static_cast<uint32_t>(i)).second) {
      return CorruptionError(std::string(file) + ": shard " + Quoted(shard.Path()) +
                             " is listed twice");
    }
    m.shards.push_back(std::move(shard));
  }
  return Status::Ok();
}

Status ParseTensors(std::string_view file, const Json& list, const ShardIndex& index,
                    Manifest& m) {
  m.tensors.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    ASSIGN_OR_RETURN(ManifestTensor tensor, ParseTensor(file, i, list[i], index, m.format_version));
    m.tensors.push_back(std::move(tensor));
  }
  return Status::Ok();
}

// The scalar fields, format_version first: a manifest from a newer writer is
// reported as such, not as a pile of unknown fields.
Status ParseTopLevel(const FieldReader& r, Manifest& m) {
  ASSIGN_OR_RETURN(int64_t version, r.I64("format_version"));
  if (version < kManifestFormatVersion || version > kLatestFormatVersion) {
    return r.Error("unsupported format_version " + std::to_string(version) + " (this reader knows " +
                   std::to_string(kManifestFormatVersion) + " to " + std::to_string(kLatestFormatVersion) + ")");
  }
  m.format_version = static_cast<int>(version);
  RETURN_IF_ERROR(r.CheckKeys(
      {"format_version", "step", "created", "writer", "metadata", "shards", "tensors"}));
  ASSIGN_OR_RETURN(m.step, r.I64("step"));
  ASSIGN_OR_RETURN(m.created, r.String("created"));
  if (!IsRfc3339Utc(m.created)) {
    return r.Error("created " + Quoted(m.created) + " is not an RFC 3339 UTC time");
  }
  ASSIGN_OR_RETURN(m.writer, r.String("writer"));
  ASSIGN_OR_RETURN(const Json* metadata, r.Object("metadata"));
  m.metadata = *metadata;
  return Status::Ok();
}

// ---- Validating -----------------------------------------------------------

Status CheckShards(std::string_view file, const std::vector<ManifestShard>& shards) {
  std::unordered_set<std::string> names;
  for (const ManifestShard& s : shards) {
    if (Status st = CheckShardFileName(s.name); !st.ok()) return AsCorruption(file, st);
    const std::string context = std::string(file) + ": shard " + Quoted(s.Path());
    if (!s.checkpoint.empty()) {
      // A directory (object prefix) directly under the root: a plain name,
      // never "..", never a save in flight.
      if (Status st = CheckShardFileName(s.checkpoint); !st.ok()) {
        return CorruptionError(context + ": its checkpoint " + st.message());
      }
      if (s.checkpoint.find(".tmp-") != std::string::npos) {
        return CorruptionError(context + ": its checkpoint is an unfinished save's directory");
      }
    }
    if (!names.insert(s.Path()).second) return CorruptionError(context + " is listed twice");
    if (s.bytes > kMaxShardBytes) {
      return CorruptionError(context + ": " + std::to_string(s.bytes) +
                             " bytes exceeds the 2 PiB (2^51 bytes) shard limit");
    }
  }
  return Status::Ok();
}

Status CheckTensor(const std::string& context, const ManifestTensor& t,
                   const std::vector<ManifestShard>& shards) {
  if (t.shard >= shards.size()) {
    return CorruptionError(context + ": shard index " + std::to_string(t.shard) +
                           " is out of range (" + std::to_string(shards.size()) + " shards)");
  }
  auto bytes = base::TensorBytes(t.dtype, t.shape);
  if (!bytes.ok()) return AsCorruption(context, bytes.status());
  if (*bytes != t.bytes) {
    return CorruptionError(context + ": bytes " + std::to_string(t.bytes) +
                           " do not match shape " + base::ShapeToString(t.shape) + " x " +
                           std::string(base::DTypeName(t.dtype)) + " = " + std::to_string(*bytes) +
                           " bytes");
  }
  const ManifestShard& shard = shards[t.shard];
  // Written as two comparisons so that offset + bytes cannot overflow.
  if (t.offset > shard.bytes || t.bytes > shard.bytes - t.offset) {
    return CorruptionError(context + ": offset " + std::to_string(t.offset) + " + " +
                           std::to_string(t.bytes) + " bytes runs past the end of shard " +
                           Quoted(shard.Path()) + " (" + std::to_string(shard.bytes) + " bytes)");
  }
  return Status::Ok();
}

// Sorted by (shard, offset), each non-empty tensor must start at or after
// the end of the one before it in its shard; while that holds, the one before
// is also the one reaching furthest.
Status CheckNoOverlaps(std::string_view file, const Manifest& m) {
  std::vector<size_t> order;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (m.tensors[i].bytes > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ManifestTensor& x = m.tensors[a];
    const ManifestTensor& y = m.tensors[b];
    return x.shard != y.shard ? x.shard < y.shard : x.offset < y.offset;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const ManifestTensor& prev = m.tensors[order[k - 1]];
    const ManifestTensor& cur = m.tensors[order[k]];
    // CheckTensor has bounded both by the shard size: the sum cannot overflow.
    if (cur.shard == prev.shard && cur.offset < prev.offset + prev.bytes) {
      return CorruptionError(std::string(file) + ": tensors " + Quoted(prev.name) + " and " +
                             Quoted(cur.name) + " overlap in shard " +
                             Quoted(m.shards[cur.shard].Path()));
    }
  }
  return Status::Ok();
}

// ---- Checking a shard against the manifest ---------------------------------

Status CompareTensor(const std::string& context, const ManifestTensor& t,
                     const TensorEntry& e, uint64_t data_start) {
  if (e.dtype != t.dtype) {
    return CorruptionError(context + ": dtype " + std::string(base::DTypeName(e.dtype)) +
                           " in the shard header, " + std::string(base::DTypeName(t.dtype)) +
                           " in the manifest");
  }
  if (e.shape != t.shape) {
    return CorruptionError(context + ": shape " + base::ShapeToString(e.shape) +
                           " in the shard header, " + base::ShapeToString(t.shape) + " in the manifest");
  }
  // Compared without adding, so a forged header cannot overflow the sum.
  const bool same_offset = t.offset >= data_start && t.offset - data_start == e.begin;
  if (!same_offset || e.end < e.begin || e.end - e.begin != t.bytes) {
    return CorruptionError(context + ": data at offset " + std::to_string(t.offset) + " (" +
                           std::to_string(t.bytes) + " bytes) in the manifest, data_offsets [" +
                           std::to_string(e.begin) + ", " + std::to_string(e.end) +
                           "] after the header's " + std::to_string(data_start) +
                           " bytes in the shard");
  }
  return Status::Ok();
}

// Every tensor of the header must be one the manifest places in this shard.
Status CheckNoExtraTensors(const std::string& shard_name, const Manifest& m, size_t shard_index,
                           const SafetensorsHeader& header) {
  std::unordered_set<std::string_view> listed;
  for (const ManifestTensor& t : m.tensors) {
    if (t.shard == shard_index) listed.insert(t.name);
  }
  for (const TensorEntry& e : header.tensors) {
    if (!listed.contains(e.name)) {
      return CorruptionError(shard_name + ": tensor " + Quoted(e.name) +
                             " is in the shard header but not in the manifest");
    }
  }
  return Status::Ok();
}

// The parser refuses JSON nested kMaxJsonDepth deep, and metadata sits one
// level inside the manifest: a writer must keep its containers within
// `levels` further levels, or it would commit a manifest no reader accepts.
bool NestsWithin(const Json& j, int levels) {
  if (!j.is_structured()) return true;
  if (levels < 0) return false;
  for (const Json& child : j) {
    if (!NestsWithin(child, levels - 1)) return false;
  }
  return true;
}

bool IsDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int FieldValue(std::string_view s, size_t pos, size_t len) {
  int v = 0;
  for (char c : s.substr(pos, len)) v = v * 10 + (c - '0');
  return v;
}

}  // namespace

std::string SerializeManifest(const Manifest& m) {
  std::string out = "{\n";
  out += "  \"format_version\": " + std::to_string(m.format_version) + ",\n";
  out += "  \"step\": " + std::to_string(m.step) + ",\n";
  out += "  \"created\": " + Compact(Json(m.created)) + ",\n";
  out += "  \"writer\": " + Compact(Json(m.writer)) + ",\n";
  // Pretty-printed JSON has newlines only between tokens (strings escape
  // theirs), so indenting every line nests it safely.
  std::string metadata = m.metadata.dump(2, ' ', false, Json::error_handler_t::replace);
  for (size_t p = 0; (p = metadata.find('\n', p)) != std::string::npos; p += 3) {
    metadata.insert(p + 1, "  ");
  }
  out += "  \"metadata\": " + metadata + ",\n";
  AppendArray(out, "shards", m.shards, ShardJson);
  out += ",\n";
  AppendArray(out, "tensors", m.tensors,
              [&](const ManifestTensor& t) { return TensorJson(t, m.shards); });
  out += "\n}\n";
  return out;
}

Result<Manifest> ParseManifest(std::string_view file, std::string_view bytes, Chunks chunks) {
  if (bytes.size() > kMaxManifestBytes) {
    return CorruptionError(std::string(file) + ": manifest of " + std::to_string(bytes.size()) +
                           " bytes exceeds the 256 MiB limit");
  }
  try {
    ASSIGN_OR_RETURN(Json root, ParseUntrustedJson(file, "manifest", bytes));
    if (!root.is_object()) {
      return CorruptionError(std::string(file) + ": manifest is not a JSON object");
    }
    const FieldReader r(std::string(file), root);
    Manifest m;
    RETURN_IF_ERROR(ParseTopLevel(r, m));
    ASSIGN_OR_RETURN(const Json* shards, r.Array("shards"));
    ASSIGN_OR_RETURN(const Json* tensors, r.Array("tensors"));
    ShardIndex index;
    RETURN_IF_ERROR(ParseShards(file, *shards, m, index));
    RETURN_IF_ERROR(ParseTensors(file, *tensors, index, m));
    RETURN_IF_ERROR(ValidateManifest(file, m, chunks));
    return m;
  } catch (const Json::exception& e) {
    // The checks above make this unreachable; a bug must still not escape.
    return InternalError(std::string(file) + ": unexpected JSON error: " + e.what());
  }
}

Status ValidateManifest(std::string_view file, const Manifest& m, Chunks chunks) {
  if (m.format_version < kManifestFormatVersion || m.format_version > kLatestFormatVersion) {
    return CorruptionError(std::string(file) + ": unsupported format_version " +
                           std::to_string(m.format_version));
  }
  if (const int needed = FormatVersionFor(m); m.format_version < needed) {
    return CorruptionError(std::string(file) + ": " +
                           (needed == kChunkedFormatVersion ? "tensors split into chunks"
                                                            : "content hashes and shards of other checkpoints") +
                           " need format_version " + std::to_string(needed) + ", the manifest says " +
                           std::to_string(m.format_version));
  }
  if (m.step < 0) {
    return CorruptionError(std::string(file) + ": step " + std::to_string(m.step) +
                           " is negative");
  }
  if (!m.metadata.is_object()) {
    return CorruptionError(std::string(file) + ": metadata is not a JSON object");
  }
  if (constexpr int kLevels = kMaxJsonDepth - 2; !NestsWithin(m.metadata, kLevels)) {
    return CorruptionError(std::string(file) + ": metadata nests deeper than " +
                           std::to_string(kLevels) + " levels");
  }
  RETURN_IF_ERROR(CheckShards(file, m.shards));
  std::unordered_set<std::string_view> names;
  for (const ManifestTensor& t : m.tensors) {
    if (Status st = CheckTensorName(t.name); !st.ok()) return AsCorruption(file, st);
    const std::string context = std::string(file) + ": tensor " + Quoted(t.name);
    if (!names.insert(t.name).second) return CorruptionError(context + " is listed twice");
    RETURN_IF_ERROR(CheckTensor(context, t, m.shards));
  }
  RETURN_IF_ERROR(CheckChunks(file, m.tensors, chunks));
  return CheckNoOverlaps(file, m);
}

bool IsCopyOfEarlierFile(std::string_view name) {
  // A step's own files have one dot, before the extension.
  const size_t dot = name.find('.');
  return dot != std::string_view::npos && dot != name.rfind('.');
}

Status CheckShardMatchesManifest(const Manifest& m, size_t shard_index,
                                 const SafetensorsHeader& header, uint64_t file_size, bool subset) {
  if (shard_index >= m.shards.size()) {
    return InvalidArgumentError("shard index " + std::to_string(shard_index) +
                                " is out of range (" + std::to_string(m.shards.size()) +
                                " shards)");
  }
  const ManifestShard& shard = m.shards[shard_index];
  if (file_size != shard.bytes) {
    return CorruptionError(shard.Path() + ": file is " + std::to_string(file_size) +
                           " bytes, the manifest says " + std::to_string(shard.bytes));
  }
  std::unordered_map<std::string_view, const TensorEntry*> by_name;
  for (const TensorEntry& e : header.tensors) by_name.emplace(e.name, &e);
  for (const ManifestTensor& t : m.tensors) {
    if (t.shard != shard_index) continue;
    const std::string context = shard.Path() + ": tensor " + Quoted(t.name);
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      return CorruptionError(context + " is in the manifest but not in the shard header");
    }
    RETURN_IF_ERROR(CompareTensor(context, t, *it->second, header.data_start));
  }
  // An earlier checkpoint's shard also holds the tensors that changed since,
  // and so does its copy under this step's name ("checkpoint_1.shard-00000
  // .safetensors": a tier that lacked the earlier step's file got it so).
  if (subset || !shard.checkpoint.empty() || IsCopyOfEarlierFile(shard.name)) return Status::Ok();
  return CheckNoExtraTensors(shard.name, m, shard_index, header);
}

std::string FormatRfc3339Utc(std::chrono::system_clock::time_point t) {
  const time_t seconds = std::chrono::system_clock::to_time_t(t);
  struct tm utc {};
  gmtime_r(&seconds, &utc);
  char text[32];
  strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

bool IsRfc3339Utc(std::string_view s) {
  // YYYY-MM-DDTHH:MM:SS, then an optional fraction, then Z.
  static constexpr std::string_view kShape = "dddd-dd-ddTdd:dd:dd";
  if (s.size() < kShape.size() + 1 || s.back() != 'Z') return false;
  for (size_t i = 0; i < kShape.size(); ++i) {
    const bool ok = kShape[i] == 'd' ? (s[i] >= '0' && s[i] <= '9') : s[i] == kShape[i];
    if (!ok) return false;
  }
  const std::string_view rest = s.substr(kShape.size(), s.size() - kShape.size() - 1);
  if (!rest.empty() && (rest.front() != '.' || !IsDigits(rest.substr(1)))) return false;
  const int month = FieldValue(s, 5, 2), day = FieldValue(s, 8, 2);
  return month >= 1 && month <= 12 && day >= 1 && day <= 31 && FieldValue(s, 11, 2) <= 23 &&
         FieldValue(s, 14, 2) <= 59 && FieldValue(s, 17, 2) <= 60;
}

}  // namespace ckptio::format
