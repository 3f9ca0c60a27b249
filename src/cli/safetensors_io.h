#pragma once
// Safetensors files outside checkpoints: the inputs of `ckptio save` and the
// output of `ckptio export`.
//
// Metadata: a checkpoint's is a JSON object; safetensors' "__metadata__" maps
// strings to strings. Export stores string values as they are and any other
// value as its JSON text; save reads "__metadata__" back as an object of
// strings. So export -> save -> export reproduces the same file byte for byte.

#include <map>
#include <string>
#include <vector>

#include "ckptio/status.h"
#include "ckptio/tensor.h"
#include "cli/files.h"
#include "format/safetensors.h"

namespace ckptio::cli {

// An input file, mapped read-only, with its validated header.
struct SafetensorsInput {
  MappedFile file;
  format::SafetensorsHeader header;
};

// Maps `path` and validates its header as hostile input. A malformed file is
// InvalidArgument (bad input, not a storage failure) naming the file.
Result<SafetensorsInput> OpenSafetensors(const std::string& path);

// The input's tensors in data order, pointing into its mapping (valid while
// `input` lives).
std::vector<TensorRef> TensorRefsOf(const SafetensorsInput& input);

// The "__metadata__" to write for a checkpoint's metadata JSON object.
std::map<std::string, std::string> SafetensorsMetadata(const std::string& metadata_json);

// The checkpoint metadata JSON object for a "__metadata__" map.
std::string MetadataJson(const std::map<std::string, std::string>& metadata);

}  // namespace ckptio::cli
