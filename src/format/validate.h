#pragma once
// Checks shared by the safetensors and manifest code: names that become keys
// or file names, and quoting of untrusted strings in error messages.
//
// The checks return InvalidArgument: the planner reports them to the caller
// who passed the name. Parsers of untrusted files turn them into Corruption
// naming the file with AsCorruption().

#include <string>
#include <string_view>

#include "base/text.h"
#include "ckptio/status.h"

namespace ckptio::format {

// Quoting and UTF-8 checks of outside text live in the base layer.
using base::IsValidUtf8;
using base::Quoted;

// A tensor name is a key in two JSON documents and may become a path when a
// tool extracts tensors, so: non-empty, valid UTF-8, no NUL, not absolute,
// no ".." component, and not the safetensors "__metadata__" key.
Status CheckTensorName(std::string_view name);

// A shard name is a file name inside the checkpoint directory or a GCS object
// suffix: 1-255 characters of [A-Za-z0-9._-], not "." or "..".
Status CheckShardFileName(std::string_view name);

// "context: <status message>" as a Corruption error.
Status AsCorruption(std::string_view context, const Status& status);

}  // namespace ckptio::format
