// Fuzz target: the config parser on arbitrary text.
//
// A rejection must be an InvalidArgument naming the source. Accepted Options
// must pass ValidateOptions, and ToJson of them must parse back to the same
// Options, except for the secrets ToJson redacts (header values, userinfo in
// the endpoint URL), which come back as "<redacted>". At start-up, the
// defaults document must parse to Options{}.

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ckptio/options.h"
#include "config/config.h"
#include "config/knobs.h"
#include "fuzz_check.h"

namespace ckptio::fuzz {
namespace {

constexpr std::string_view kSource = "fuzz.json";

void CheckRejection(const Status& s) {
  FUZZ_CHECK(s.code() == StatusCode::kInvalidArgument, s.ToString().substr(0, 500));
  FUZZ_CHECK(s.message().starts_with("config " + std::string(kSource) + ": "),
             s.message().substr(0, 300));
}

// `o` as ToJson prints it, read back: the redacted values replaced.
Options Redacted(const Options& o) {
  Options r = o;
  for (auto& [name, value] : r.gcs.headers) {
    if (config::IsSecretValue(name, value)) value = "<redacted>";
  }
  const config::Knob* endpoint = config::FindKnob("gcs.endpoint");
  FUZZ_CHECK(endpoint != nullptr, "no gcs.endpoint knob");
  r.gcs.endpoint =
      nlohmann::json::parse(config::RenderKnob(*endpoint, o, /*redact=*/true)).get<std::string>();
  return r;
}

}  // namespace
}  // namespace ckptio::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  using namespace ckptio;
  auto defaults = config::ParseConfig(config::DefaultsDocument(), "defaults");
  FUZZ_CHECK_OK(defaults, "the defaults document");
  FUZZ_CHECK(*defaults == Options{}, "the defaults document does not give Options{}");
  auto again = config::ParseConfig(config::ToJson(Options{}), "defaults");
  FUZZ_CHECK_OK(again, "ToJson(Options{})");
  FUZZ_CHECK(*again == Options{}, "ToJson(Options{}) does not give Options{}");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptio;
  using namespace ckptio::fuzz;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto options = config::ParseConfig(text, kSource);
  if (!options.ok()) {
    CheckRejection(options.status());
    return 0;
  }
  FUZZ_CHECK_OK(config::ValidateOptions(*options), "ValidateOptions of parsed options");
  // These reach open(2), curl or object names as C strings: a NUL would
  // silently cut them short, so that ckptio used another path than the one
  // configured.
  for (const std::string* s : {&options->prefix, &options->trace.path, &options->gcs.endpoint,
                               &options->gcs.ca_file, &options->gcs.user_project}) {
    FUZZ_CHECK(s->find('\0') == std::string::npos, "a NUL byte in a path or name knob");
  }
  FUZZ_CHECK(options->prefix.find('/') == std::string::npos, options->prefix);
  const std::string json = config::ToJson(*options);
  auto again = config::ParseConfig(json, kSource);
  FUZZ_CHECK_OK(again, "ToJson output:\n" + json.substr(0, 2000));
  FUZZ_CHECK(*again == Redacted(*options), "ToJson does not round-trip:\n" + json.substr(0, 2000));
  FUZZ_CHECK(config::ToJson(*again) == json, "ToJson is not stable");
  return 0;
}
