#pragma once
// The config file: JSON (with // and /* */ comments) -> validated Options.
//
// Keys are the member names of Options, nested as in the struct:
//   {"shard_size": "512MiB", "io": {"block_size": "4MiB"}, "gcs": {"retry": {"max_attempts": 3}}}
// A key the file leaves out keeps its default. Unknown keys, duplicate keys
// and values of the wrong type are errors, never ignored: a typo in a tuning
// knob should fail loudly, not silently run with the default.
//
// Every parse/validation error is InvalidArgument and names the file and the
// key: `config /etc/ckptio.json: key "gcs.retry.max_attempts": expected an
// integer, got string "three"`. All functions are pure apart from the file
// and environment reads of LoadConfigFile / LoadConfig; any thread.

#include <string>
#include <string_view>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "config/units.h"  // ParseSize, ParseDuration, FormatSize, FormatDuration

namespace ckptio::config {

// The environment variable naming a config file when no path is given.
inline constexpr const char* kConfigEnvVar = "CKPTIO_CONFIG";

// Defaults overridden by what `text` sets, then validated. `source` names the
// text in error messages (normally the file's path).
Result<Options> ParseConfig(std::string_view text, std::string_view source);

// Reads and parses the file. A file that cannot be read is an error naming
// the path and the errno text, with the errno's code (NotFound,
// PermissionDenied, ...) rather than InvalidArgument.
Result<Options> LoadConfigFile(const std::string& path);

// `path_or_empty` if not empty, else the file named by $CKPTIO_CONFIG if set
// and not empty, else the defaults.
Result<Options> LoadConfig(const std::string& path_or_empty);

// The rules ParseConfig applies after parsing (ranges, multiples, allowed
// strings, backoff ordering), for Options filled in code. Message:
// `key "io.block_size": must be a multiple of 4KiB (...), got 1000B`.
Status ValidateOptions(const Options& options);

// Every knob with its default and a `// description` line, as a config file
// that ParseConfig accepts and that yields Options{}. Printed by
// `ckptio config defaults`.
std::string DefaultsDocument();

// The effective config as a JSON document in config-file notation ("256MiB",
// "30s"), without comments. Secrets (values of headers such as Authorization,
// header values that look like credentials whatever the header's name,
// credentials in the endpoint URL) print as "<redacted>"; everything else
// parses back to the same Options.
std::string ToJson(const Options& options);

}  // namespace ckptio::config
