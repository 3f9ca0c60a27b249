#pragma once
// The knob table: one row per config key, from which parsing, validation,
// the defaults document, ToJson and unknown-key detection are all derived,
// so that none of them can drift from the others or from Options.
//
// A row holds the key path, a one-line description and a typed spec: the
// accessor of the Options field plus the rules its value must obey. Defaults
// are not in the table: they are read from a default-constructed Options, the
// one place they are written down. Group rows ("io", "gcs.retry") stand for
// nested objects; every other row's parent is a group listed before it, and a
// group's rows follow it contiguously (the renderer relies on that).

#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json_fwd.hpp>  // nlohmann::ordered_json
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "ckptio/options.h"
#include "ckptio/status.h"

namespace ckptio::config {

inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Read and write access to one field of Options. Built from a captureless
// generic lambda `[](auto& o) -> auto& { return o.io.block_size; }`, called
// through both function pointers. (Not converted to them directly: clang 14,
// which builds the fuzz targets, cannot deduce the `auto&` return type when
// converting to the const one.)
template <typename T>
struct Field {
  T& (*mut)(Options&);
  const T& (*get)(const Options&);
  template <typename Lambda>
    requires std::is_convertible_v<Lambda, T& (*)(Options&)> &&
             std::is_default_constructible_v<Lambda>
  Field(Lambda)  // NOLINT: implicit on purpose
      : mut([](Options& o) -> T& { return Lambda{}(o); }),
        get([](const Options& o) -> const T& { return Lambda{}(o); }) {}
};

struct GroupSpec {};

struct SizeSpec {
  Field<uint64_t> field;
  uint64_t min = 1;
  uint64_t max = std::numeric_limits<uint64_t>::max();
  uint64_t multiple_of = 1;
  std::string_view why_multiple = {};  // shown when the multiple_of rule fails
  // The value 0 is spelled "auto" (and allowed whatever min says).
  bool allow_auto = false;
};

template <typename T>
struct IntSpec {
  Field<T> field;
  T min;
  T max;
};

struct BoolSpec {
  Field<bool> field;
};

struct StringSpec {
  Field<std::string> field;
  Status (*check)(std::string_view value) = nullptr;   // nullptr: any string
  std::string (*redact)(std::string_view value) = nullptr;  // for printing; nullptr: as is
};

struct DurationSpec {
  Field<std::chrono::milliseconds> field;
  std::chrono::milliseconds min{0};
};

// One allowed value of an enum knob, as its JSON text: "\"copy\"", "true".
template <typename E>
struct Choice {
  std::string_view json;
  E value;
};

template <typename E>
struct EnumSpec {
  Field<E> field;
  std::span<const Choice<E>> choices;
};

struct HeadersSpec {
  Field<std::map<std::string, std::string>> field;
};

using Spec = std::variant<GroupSpec, SizeSpec, IntSpec<int>, IntSpec<int64_t>, BoolSpec,
                          StringSpec, DurationSpec, EnumSpec<SnapshotMode>, EnumSpec<SnapshotCrc>, EnumSpec<OnBusy>,
                          EnumSpec<Options::Io::Direct>, HeadersSpec>;

struct Knob {
  std::string_view path;  // "gcs.retry.max_attempts"
  std::string_view description;
  Spec spec;

  bool is_group() const { return std::holds_alternative<GroupSpec>(spec); }
};

// Every knob and group, in document order.
std::span<const Knob> Knobs();

// The row for a full key path, or nullptr.
const Knob* FindKnob(std::string_view path);

// Sets the knob's field from a JSON value. REQUIRES: !knob.is_group().
// (ordered_json: the parser keeps the file's key order, so the first error
// reported is the first one in the file.)
// The error message leaves out the key ("expected an integer, got string
// \"three\""); the caller names the file and key.
Status ParseKnob(const Knob& knob, const nlohmann::ordered_json& value, Options& options);

// The knob's rules (ranges, multiples, allowed strings) applied to its value
// in `options`; the message leaves out the key, as for ParseKnob.
Status CheckKnob(const Knob& knob, const Options& options);

// The field's value as JSON text in the config file's own notation ("256MiB",
// "30s", "copy"), on one line. With `redact`, secrets become "<redacted>".
std::string RenderKnob(const Knob& knob, const Options& options, bool redact);

// What values the knob takes, for the defaults document: "size, a multiple
// of 256KiB", "integer in [1, 1024]", "\"copy\" or \"borrow\"".
std::string DescribeType(const Knob& knob);

// What a JSON value is, for error messages: "string \"three\"", "number 3.5",
// "null", "an object".
std::string DescribeJson(const nlohmann::ordered_json& value);

// True for header names whose values must never be printed.
bool IsSecretHeader(std::string_view name);

// True for a header whose value must never be printed: a secret-looking name,
// or a value that looks like a credential ("Bearer ...", "ya29.", a long
// random token: base::LooksLikeCredential), whatever the name.
bool IsSecretValue(std::string_view name, std::string_view value);

// The rule every gcs.headers map obeys: valid HTTP names, no CR, LF or NUL in
// values, none of the headers the upload protocol sets, no name twice.
Status CheckHeaders(const std::map<std::string, std::string>& headers);

}  // namespace ckptio::config
