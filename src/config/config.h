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

#include "ckptio/config.h"
#include "ckptio/options.h"
#include "ckptio/status.h"
#include "config/units.h"  // ParseSize, ParseDuration, FormatSize, FormatDuration

namespace ckptio::config {

// LoadConfig, LoadConfigFile, ParseConfig, ValidateOptions and kConfigEnv are
// public: include/ckptio/config.h.

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
