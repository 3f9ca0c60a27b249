#include "format/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <unordered_set>

#include "base/status_macros.h"
#include "format/json_reader.h"
#include "format/validate.h"

namespace ckptio::format {
namespace {

std::string OffsetsToString(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

std::string_view AsChars(std::span<const uint8_t> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// ---- Parsing --------------------------------------------------------------

Status ParseMetadata(std::string_view file, const Json& value,
                     std::map<std::string, std::string>& metadata) {
  const std::string context = std::string(file) + ": __metadata__";
  if (!value.is_object()) return CorruptionError(context + " is not a JSON object");
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      return CorruptionError(context + ": value of " + Quoted(key) + " is not a string");
    }
    metadata.emplace(key, v.get<std::string>());
  }
  return Status::Ok();
}

// Checks an entry's offsets against its own shape and the data section.
Status CheckEntryBounds(const FieldReader& r, const TensorEntry& e, uint64_t data_size) {
  const std::string offsets = "data_offsets " + OffsetsToString(e.begin, e.end);
  if (e.begin > e.end) return r.Error(offsets + " have begin after end");
  if (e.end > data_size) {
    return r.Error(offsets + " run past the end of the data section (" +
                   std::to_string(data_size) + " bytes)");
  }
  auto bytes = base::TensorBytes(e.dtype, e.shape);
  if (!bytes.ok()) return AsCorruption(r.context(), bytes.status());
  if (e.end - e.begin != *bytes) {
    return r.Error(offsets + " do not match shape " + base::ShapeToString(e.shape) + " x " +
                   std::string(base::DTypeName(e.dtype)) + " = " + std::to_string(*bytes) + " bytes");
  }
  return Status::Ok();
}

Result<TensorEntry> ParseEntry(std::string_view file, const std::string& name,
                               const Json& value, uint64_t data_size) {
  if (Status s = CheckTensorName(name); !s.ok()) return AsCorruption(file, s);
  const std::string context = std::string(file) + ": tensor " + Quoted(name);
  if (!value.is_object()) return CorruptionError(context + ": entry is not a JSON object");
  const FieldReader r(context, value);
  RETURN_IF_ERROR(r.CheckKeys({"dtype", "shape", "data_offsets"}));
  TensorEntry e;
  e.name = name;
  ASSIGN_OR_RETURN(std::string dtype, r.String("dtype"));
  auto parsed_dtype = base::ParseDType(dtype);
  if (!parsed_dtype.ok()) return AsCorruption(context, parsed_dtype.status());
  e.dtype = *parsed_dtype;
  ASSIGN_OR_RETURN(e.shape, r.U64Array("shape"));
  ASSIGN_OR_RETURN(std::vector<uint64_t> offsets, r.U64Array("data_offsets"));
  if (offsets.size() != 2) return r.Error("field \"data_offsets\" must be [begin, end]");
  e.begin = offsets[0];
  e.end = offsets[1];
  RETURN_IF_ERROR(CheckEntryBounds(r, e, data_size));
  return e;
}

// Sorts the tensors by offset and checks they tile [0, data_size) exactly, as
// safetensors requires: a hole or an overlap means a corrupt or forged file.
Status CheckTiling(std::string_view file, std::vector<TensorEntry>& tensors, uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const std::string prefix = std::string(file) + ": ";
  uint64_t covered = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorEntry& t = tensors[i];
    if (t.begin < covered) {
      const TensorEntry& prev = tensors[i - 1];
      return CorruptionError(prefix + "tensors " + Quoted(prev.name) + " " +
                             OffsetsToString(prev.begin, prev.end) + " and " + Quoted(t.name) +
                             " " + OffsetsToString(t.begin, t.end) + " overlap");
    }
    if (t.begin > covered) {
      return CorruptionError(prefix + "hole of " + std::to_string(t.begin - covered) +
                             " bytes before tensor " + Quoted(t.name) + " " +
                             OffsetsToString(t.begin, t.end) +
                             " (safetensors requires contiguous tensors)");
    }
    covered = t.end;
  }
  if (covered != data_size) {
    return CorruptionError(prefix + std::to_string(data_size - covered) +
                           " bytes of data after the last tensor (the data section is " +
                           std::to_string(data_size) + " bytes, tensors cover " +
                           std::to_string(covered) + ")");
  }
  return Status::Ok();
}

// ---- Building -------------------------------------------------------------

std::string JsonString(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string EntryJson(const TensorEntry& t) {
  Json entry = Json::object();
  entry["dtype"] = std::string(base::DTypeName(t.dtype));
  entry["shape"] = t.shape;
  entry["data_offsets"] = Json::array({t.begin, t.end});
  return entry.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// The header JSON written key by key: a JSON object type would either sort
// the keys or (ordered_json) look each one up linearly, quadratic in the
// number of tensors.
std::string HeaderJson(std::span<const TensorEntry> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::string out = "{";
  if (!metadata.empty()) {
    Json m(metadata);
    out += "\"__metadata__\":" + m.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  for (const TensorEntry& t : tensors) {
    if (out.size() > 1) out += ',';
    out += JsonString(t.name);
    out += ':';
    out += EntryJson(t);
  }
  out += '}';
  return out;
}

// ---- Planning -------------------------------------------------------------

// Block sizes are 512 B to 64 KiB; a larger alignment is a configuration error.
constexpr size_t kMaxAlign = size_t{1} << 20;

Status CheckSpecs(std::span<const TensorSpec> specs) {
  std::unordered_set<std::string_view> names;
  for (const TensorSpec& spec : specs) {
    RETURN_IF_ERROR(CheckTensorName(spec.name));
    const std::string context = "tensor " + Quoted(spec.name);
    if (!names.insert(spec.name).second) {
      return InvalidArgumentError(context + " appears twice");
    }
    auto bytes = base::TensorBytes(spec.dtype, spec.shape);
    if (!bytes.ok()) return bytes.status().WithContext(context);
    if (*bytes != spec.bytes) {
      return InvalidArgumentError(context + ": bytes " + std::to_string(spec.bytes) +
                                  " do not match shape " + base::ShapeToString(spec.shape) + " x " +
                                  std::string(base::DTypeName(spec.dtype)) + " = " +
                                  std::to_string(*bytes) + " bytes");
    }
  }
  return Status::Ok();
}

std::string ShardName(std::string_view name_prefix, size_t index) {
  char digits[24];
  std::snprintf(digits, sizeof(digits), "%05zu", index);
  return std::string(name_prefix) + digits + ".safetensors";
}

Status CheckPlanArgs(std::span<const TensorSpec> specs, uint64_t shard_size, size_t align,
                     std::string_view name_prefix) {
  if (shard_size == 0 || shard_size > base::kMaxTensorBytes) {
    return InvalidArgumentError("shard_size " + std::to_string(shard_size) +
                                " is outside [1, 2^50]");
  }
  if (align == 0 || align > kMaxAlign) {
    return InvalidArgumentError("shard alignment " + std::to_string(align) +
                                " is outside [1, 1 MiB]");
  }
  // Names with more digits are checked as they are made; this catches a bad
  // prefix before any work.
  RETURN_IF_ERROR(CheckShardFileName(ShardName(name_prefix, 0)));
  return CheckSpecs(specs);
}

// Indices of the specs in each shard: in input order, or with residues
// grouped by residue (see PlanShards).
std::vector<std::vector<size_t>> GroupIntoShards(std::span<const TensorSpec> specs,
                                                 uint64_t shard_size, const MemoryResidues& residues) {
  std::vector<size_t> order(specs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const uint32_t m = residues.modulus;
  auto key = [&](size_t i) { return std::pair(residues.residue[i], specs[i].bytes % m != 0); };
  if (m != 0) std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  std::vector<std::vector<size_t>> groups;
  uint64_t used = 0;
  for (size_t i : order) {
    // Both terms are <= 2^50 (checked), so the sum cannot overflow.
    const bool full = !groups.empty() && !groups.back().empty() && used + specs[i].bytes > shard_size;
    const bool other_residue = m != 0 && !groups.empty() && residues.residue[groups.back().front()] != residues.residue[i];
    if (groups.empty() || full || other_residue) {
      groups.emplace_back();
      used = 0;
    }
    groups.back().push_back(i);
    used += specs[i].bytes;
  }
  return groups;
}

Result<PlannedShard> LayOutShard(std::span<const TensorSpec> specs,
                                 const std::vector<size_t>& group, std::string name,
                                 size_t align, size_t residue) {
  std::vector<TensorEntry> entries;
  entries.reserve(group.size());
  uint64_t data_bytes = 0;
  for (size_t index : group) {
    const TensorSpec& spec = specs[index];
    entries.push_back({spec.name, spec.dtype, spec.shape, data_bytes, data_bytes + spec.bytes});
    data_bytes += spec.bytes;
  }
  RETURN_IF_ERROR(CheckShardFileName(name));
  PlannedShard shard;
  shard.name = std::move(name);
  shard.prefix = BuildSafetensorsPrefix(entries, {}, align, residue);
  if (shard.prefix.size() - 8 > kMaxHeaderBytes) {
    return InvalidArgumentError("shard " + shard.name + ": header of " +
                                std::to_string(shard.prefix.size() - 8) +
                                " bytes exceeds the 100000000-byte safetensors limit");
  }
  const uint64_t data_start = shard.prefix.size();
  for (size_t i = 0; i < group.size(); ++i) {
    shard.tensors.push_back({group[i], data_start + entries[i].begin, specs[group[i]].bytes});
  }
  shard.file_size = data_start + data_bytes;
  return shard;
}

}  // namespace

Result<uint64_t> ParseHeaderLength(std::string_view file, std::span<const uint8_t> first8,
                                   uint64_t file_size) {
  const std::string prefix = std::string(file) + ": ";
  if (first8.size() < 8 || file_size < 8) {
    return CorruptionError(prefix + "file of " + std::to_string(file_size) +
                           " bytes is too short to hold the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[static_cast<size_t>(i)];
  if (n > kMaxHeaderBytes) {
    return CorruptionError(prefix + "header length " + std::to_string(n) +
                           " exceeds the 100000000-byte header limit");
  }
  if (n > file_size - 8) {
    return CorruptionError(prefix + "header length " + std::to_string(n) +
                           " runs past the end of the file (" + std::to_string(file_size) +
                           " bytes)");
  }
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view file,
                                                 std::span<const uint8_t> header_json,
                                                 uint64_t file_size) {
  const uint64_t n = header_json.size();
  if (n > kMaxHeaderBytes || file_size < 8 || n > file_size - 8) {
    return CorruptionError(std::string(file) + ": header of " + std::to_string(n) +
                           " bytes does not fit a file of " + std::to_string(file_size) +
                           " bytes within the 100000000-byte header limit");
  }
  SafetensorsHeader header;
  header.data_start = 8 + n;
  const uint64_t data_size = file_size - header.data_start;
  ASSIGN_OR_RETURN(Json root, ParseUntrustedJson(file, "header", AsChars(header_json)));
  if (!root.is_object()) {
    return CorruptionError(std::string(file) + ": header is not a JSON object");
  }
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      RETURN_IF_ERROR(ParseMetadata(file, value, header.metadata));
      continue;
    }
    ASSIGN_OR_RETURN(TensorEntry entry, ParseEntry(file, key, value, data_size));
    header.tensors.push_back(std::move(entry));
  }
  RETURN_IF_ERROR(CheckTiling(file, header.tensors, data_size));
  return header;
}

std::string BuildSafetensorsPrefix(std::span<const TensorEntry> tensors,
                                   const std::map<std::string, std::string>& metadata,
                                   size_t align, size_t residue) {
  std::string json = HeaderJson(tensors, metadata);
  if (align > 1) json.append((align - (8 + json.size()) % align) % align, ' ');
  json.append(residue, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (size_t i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xFF);
  out += json;
  return out;
}

Result<std::vector<PlannedShard>> PlanShards(std::span<const TensorSpec> specs,
                                             uint64_t shard_size, size_t align,
                                             std::string_view name_prefix, MemoryResidues residues) {
  RETURN_IF_ERROR(CheckPlanArgs(specs, shard_size, align, name_prefix));
  const uint32_t m = residues.modulus;
  if (m != 0) {
    if ((m & (m - 1)) != 0 || align % m != 0 || residues.residue.size() != specs.size()) {
      return InvalidArgumentError("memory residues: modulus " + std::to_string(m) + " must be a power of two dividing " +
                                  "the alignment " + std::to_string(align) + ", with one residue per tensor (" +
                                  std::to_string(residues.residue.size()) + " for " + std::to_string(specs.size()) + ")");
    }
    for (uint32_t r : residues.residue) {
      if (r >= m) return InvalidArgumentError("memory residue " + std::to_string(r) + " is not below " + std::to_string(m));
    }
  }
  const std::vector<std::vector<size_t>> groups = GroupIntoShards(specs, shard_size, residues);
  std::vector<PlannedShard> shards;
  shards.reserve(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    const size_t residue = m != 0 ? residues.residue[groups[i].front()] : 0;
    ASSIGN_OR_RETURN(PlannedShard shard,
                     LayOutShard(specs, groups[i], ShardName(name_prefix, i), align, residue));
    shards.push_back(std::move(shard));
  }
  return shards;
}

}  // namespace ckptio::format
