#include "cli/safetensors_io.h"

#include <nlohmann/json.hpp>
#include "base/status_macros.h"

namespace ckptio::cli {
namespace {

Status AsBadInput(const Status& s) {
  return InvalidArgumentError("invalid safetensors input: " + s.message());
}

}  // namespace

Result<SafetensorsInput> OpenSafetensors(const std::string& path) {
  ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  std::span<const uint8_t> bytes = file.bytes();
  auto n = format::ParseHeaderLength(path, bytes.first(std::min<size_t>(8, bytes.size())), bytes.size());
  if (!n.ok()) return AsBadInput(n.status());
  // ParseHeaderLength checked 8 + n <= size.
  auto header = format::ParseSafetensorsHeader(path, bytes.subspan(8, static_cast<size_t>(*n)), bytes.size());
  if (!header.ok()) return AsBadInput(header.status());
  return SafetensorsInput{std::move(file), std::move(*header)};
}

std::vector<TensorRef> TensorRefsOf(const SafetensorsInput& input) {
  std::vector<TensorRef> refs;
  refs.reserve(input.header.tensors.size());
  const uint8_t* data = input.file.bytes().data() + input.header.data_start;
  for (const format::TensorEntry& t : input.header.tensors) {
    refs.push_back({t.name, t.dtype, t.shape, t.end > t.begin ? data + t.begin : nullptr});
  }
  return refs;
}

std::map<std::string, std::string> SafetensorsMetadata(const std::string& metadata_json) {
  std::map<std::string, std::string> out;
  auto j = nlohmann::json::parse(metadata_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return out;  // the manager only stores objects
  for (const auto& [key, value] : j.items()) {
    out[key] = value.is_string() ? value.get<std::string>() : value.dump();
  }
  return out;
}

std::string MetadataJson(const std::map<std::string, std::string>& metadata) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, value] : metadata) j[key] = value;
  return j.dump();
}

}  // namespace ckptio::cli
