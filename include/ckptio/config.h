#pragma once
// Options from a JSON config file (the keys are Options' member names,
// nested as in the struct: {"shard_size": "512MiB", "io": {"block_size":
// "4MiB"}}). A key the file leaves out keeps its default; unknown keys,
// duplicate keys and values of the wrong type are errors naming the file and
// the key (`config /etc/ckptio.json: key "gcs.retry.max_attempts": expected
// an integer, got string "three"`), never ignored. `ckptio config defaults`
// prints every key with its default and what it does.
//
//   ckptio::Options options = ckptio::config::LoadConfig("ckptio.json").value();

#include <string>
#include <string_view>

#include "ckptio/export.h"
#include "ckptio/options.h"
#include "ckptio/status.h"

namespace ckptio::config {

// The environment variable naming a config file when no path is given.
inline constexpr const char* kConfigEnv = "CKPTIO_CONFIG";

// `path_or_empty` if not empty, else the file named by $CKPTIO_CONFIG if set
// and not empty, else the defaults.
CKPTIO_EXPORT Result<Options> LoadConfig(const std::string& path_or_empty);

// Reads and parses one file. A file that cannot be read is an error naming
// the path and the errno text, with the errno's code (NotFound, ...).
CKPTIO_EXPORT Result<Options> LoadConfigFile(const std::string& path);

// Defaults overridden by what `text` sets, then validated. `source` names the
// text in error messages (normally the file's path).
CKPTIO_EXPORT Result<Options> ParseConfig(std::string_view text, std::string_view source);

// The rules ParseConfig applies after parsing (ranges, multiples, allowed
// strings), for Options filled in code. Message: `key "io.block_size": must
// be a multiple of 4KiB (...), got 1000B`.
CKPTIO_EXPORT Status ValidateOptions(const Options& options);

}  // namespace ckptio::config
