// What each kind of knob does with a value: read it from JSON (Parse), check
// it in a whole Options (Check), write it back (Render) and name its type
// (Describe). The table of knobs is in knobs.cc.
#include <cmath>
#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "config/knobs.h"
#include "config/units.h"

namespace ckptio::config {
namespace {

using json = nlohmann::ordered_json;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;

// ---- JSON value -> typed value ----


Status Expected(std::string_view what, const json& v) {
  return InvalidArgumentError("expected " + std::string(what) + ", got " + DescribeJson(v));
}

// 2^63 as a double: the first value that no longer fits in int64_t.
constexpr double kTwoTo63 = 9223372036854775808.0;

Result<int64_t> IntegerFromJson(const json& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(kInt64Max)) return Expected("an integer", v);
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    // 1e3 is written as a float in JSON; accept it when it is a whole number.
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && d >= -kTwoTo63 && d < kTwoTo63) {
      return static_cast<int64_t>(d);
    }
  }
  return Expected("an integer", v);
}

Result<uint64_t> SizeFromJson(const json& v) {
  if (v.is_string()) return ParseSize(v.get_ref<const std::string&>());
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && d >= 0 && d < 2 * kTwoTo63) {
      return static_cast<uint64_t>(d);
    }
  }
  return Expected("a size (a number of bytes, or a string like \"256MiB\")", v);
}

Result<milliseconds> DurationFromJson(const json& v) {
  nanoseconds ns{};
  if (v.is_string()) {
    ASSIGN_OR_RETURN(ns, ParseDuration(v.get_ref<const std::string&>()));
  } else if (v.is_number()) {
    // A number is seconds and may be fractional ("0.25" = 250ms).
    const double seconds = v.get<double>();
    if (!std::isfinite(seconds) || seconds < 0 || seconds * 1e9 >= kTwoTo63) {
      return Expected("a duration of at least 0 and at most about 292 years", v);
    }
    ns = nanoseconds(std::llround(seconds * 1e9));
  } else {
    return Expected("a duration (a string like \"30s\" or \"100ms\", or a number of seconds)", v);
  }
  if (ns % milliseconds(1) != nanoseconds(0)) {
    return InvalidArgumentError("must be a whole number of milliseconds, got " +
                                FormatDuration(ns));
  }
  return std::chrono::duration_cast<milliseconds>(ns);
}

template <typename E>
std::string ChoiceList(std::span<const Choice<E>> choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) out += i + 1 == choices.size() ? " or " : ", ";
    out += choices[i].json;
  }
  return out;
}

template <typename T>
std::string RangeText(T min, T max) {
  if (max == std::numeric_limits<T>::max()) return "at least " + std::to_string(min);
  return "between " + std::to_string(min) + " and " + std::to_string(max);
}

// ---- Per-spec operations (overloads picked by std::visit) ----

Status Parse(const GroupSpec&, const json&, Options&) {
  return InternalError("a group is not a value");
}
Status Parse(const SizeSpec& s, const json& v, Options& o) {
  if (s.allow_auto && v.is_string() && v.get_ref<const std::string&>() == "auto") {
    s.field.mut(o) = 0;
    return Status::Ok();
  }
  ASSIGN_OR_RETURN(s.field.mut(o), SizeFromJson(v));
  return Status::Ok();
}
// A whole number too large for int64_t (1e20, 18446744073709551615).
bool HugeInteger(const json& v) {
  if (v.is_number_unsigned()) return true;  // IntegerFromJson took those that fit
  if (!v.is_number_float()) return false;
  const double d = v.get<double>();
  return std::isfinite(d) && d == std::trunc(d) && d >= kTwoTo63;
}
template <typename T>
Status Parse(const IntSpec<T>& s, const json& v, Options& o) {
  auto parsed = IntegerFromJson(v);
  if (!parsed.ok() && HugeInteger(v)) {
    const std::string rule = s.max == std::numeric_limits<T>::max() ? "at most " + std::to_string(s.max)
                                                                      : RangeText(s.min, s.max);
    return InvalidArgumentError("must be " + rule + ", got " + v.dump());
  }
  ASSIGN_OR_RETURN(int64_t n, std::move(parsed));
  if (n < s.min) {
    return InvalidArgumentError("must be " + RangeText(s.min, s.max) + ", got " + std::to_string(n));
  }
  if (n > s.max) {
    // "at least 0" would not say what is wrong with 2147483648: the bound it broke.
    const std::string rule = s.max == std::numeric_limits<T>::max() ? "at most " + std::to_string(s.max)
                                                                      : RangeText(s.min, s.max);
    return InvalidArgumentError("must be " + rule + ", got " + std::to_string(n));
  }
  s.field.mut(o) = static_cast<T>(n);
  return Status::Ok();
}
Status Parse(const BoolSpec& s, const json& v, Options& o) {
  if (!v.is_boolean()) return Expected("true or false", v);
  s.field.mut(o) = v.get<bool>();
  return Status::Ok();
}
Status Parse(const StringSpec& s, const json& v, Options& o) {
  if (!v.is_string()) return Expected("a string", v);
  s.field.mut(o) = v.get<std::string>();
  return Status::Ok();
}
Status Parse(const DurationSpec& s, const json& v, Options& o) {
  ASSIGN_OR_RETURN(s.field.mut(o), DurationFromJson(v));
  return Status::Ok();
}
template <typename E>
Status Parse(const EnumSpec<E>& s, const json& v, Options& o) {
  const std::string text = v.dump();
  for (const Choice<E>& c : s.choices) {
    if (text == c.json) {
      s.field.mut(o) = c.value;
      return Status::Ok();
    }
  }
  return Expected(ChoiceList(s.choices), v);
}
Status Parse(const HeadersSpec& s, const json& v, Options& o) {
  if (!v.is_object()) return Expected("an object of header names to string values", v);
  std::map<std::string, std::string> headers;
  for (const auto& [name, value] : v.items()) {
    if (!value.is_string()) {
      return Expected("a string", value).WithContext("header \"" + name + "\"");
    }
    headers[name] = value.get<std::string>();
  }
  s.field.mut(o) = std::move(headers);
  return Status::Ok();
}

Status Check(const GroupSpec&, const Options&) { return Status::Ok(); }
Status Check(const SizeSpec& s, const Options& o) {
  const uint64_t n = s.field.get(o);
  if (s.allow_auto && n == 0) return Status::Ok();
  if (n < s.min) {
    return InvalidArgumentError("must be at least " + FormatSize(s.min) + ", got " + FormatSize(n));
  }
  if (n > s.max) {
    return InvalidArgumentError("must be at most " + FormatSize(s.max) + ", got " + FormatSize(n));
  }
  if (n % s.multiple_of != 0) {
    std::string m = "must be a multiple of " + FormatSize(s.multiple_of);
    if (!s.why_multiple.empty()) m += " (" + std::string(s.why_multiple) + ")";
    return InvalidArgumentError(m + ", got " + FormatSize(n));
  }
  return Status::Ok();
}
template <typename T>
Status Check(const IntSpec<T>& s, const Options& o) {
  const T n = s.field.get(o);
  if (n >= s.min && n <= s.max) return Status::Ok();
  return InvalidArgumentError("must be " + RangeText(s.min, s.max) + ", got " + std::to_string(n));
}
Status Check(const BoolSpec&, const Options&) { return Status::Ok(); }
Status Check(const StringSpec& s, const Options& o) {
  return s.check ? s.check(s.field.get(o)) : Status::Ok();
}
Status Check(const DurationSpec& s, const Options& o) {
  const milliseconds d = s.field.get(o);
  if (d >= s.min) return Status::Ok();
  return InvalidArgumentError("must be at least " + FormatDuration(s.min) + ", got " +
                              FormatDuration(d));
}
template <typename E>
Status Check(const EnumSpec<E>& s, const Options& o) {
  const E value = s.field.get(o);
  for (const Choice<E>& c : s.choices) {
    if (c.value == value) return Status::Ok();
  }
  return InvalidArgumentError("holds an out-of-range enum value " +
                              std::to_string(static_cast<int>(value)));
}
Status Check(const HeadersSpec& s, const Options& o) { return CheckHeaders(s.field.get(o)); }

std::string Render(const GroupSpec&, const Options&, bool) { return "{}"; }
std::string Render(const SizeSpec& s, const Options& o, bool) {
  if (s.allow_auto && s.field.get(o) == 0) return "\"auto\"";
  return "\"" + FormatSize(s.field.get(o)) + "\"";
}
template <typename T>
std::string Render(const IntSpec<T>& s, const Options& o, bool) {
  return std::to_string(s.field.get(o));
}
std::string Render(const BoolSpec& s, const Options& o, bool) {
  return s.field.get(o) ? "true" : "false";
}
std::string Render(const StringSpec& s, const Options& o, bool redact) {
  const std::string& value = s.field.get(o);
  return json(redact && s.redact ? s.redact(value) : value).dump();
}
std::string Render(const DurationSpec& s, const Options& o, bool) {
  return "\"" + FormatDuration(s.field.get(o)) + "\"";
}
template <typename E>
std::string Render(const EnumSpec<E>& s, const Options& o, bool) {
  const E value = s.field.get(o);
  for (const Choice<E>& c : s.choices) {
    if (c.value == value) return std::string(c.json);
  }
  return "null";  // only reachable for a value CheckKnob rejects
}
std::string Render(const HeadersSpec& s, const Options& o, bool redact) {
  std::string out = "{";
  for (const auto& [name, value] : s.field.get(o)) {
    if (out.size() > 1) out += ", ";
    const bool hide = redact && IsSecretValue(name, value);
    out += json(name).dump() + ": " + json(hide ? std::string("<redacted>") : value).dump();
  }
  return out + "}";
}

std::string Describe(const GroupSpec&) { return "object"; }
std::string Describe(const SizeSpec& s) {
  std::string out = s.allow_auto ? "size or \"auto\"" : "size";
  if (s.min > 1) out += ", at least " + FormatSize(s.min);
  if (s.max != std::numeric_limits<uint64_t>::max()) out += ", at most " + FormatSize(s.max);
  if (s.multiple_of > 1) out += ", a multiple of " + FormatSize(s.multiple_of);
  return out;
}
template <typename T>
std::string Describe(const IntSpec<T>& s) {
  return "integer, " + RangeText(s.min, s.max);
}
std::string Describe(const BoolSpec&) { return "true or false"; }
std::string Describe(const StringSpec&) { return "string"; }
std::string Describe(const DurationSpec& s) {
  return s.min.count() > 0 ? "duration, at least " + FormatDuration(s.min) : "duration";
}
template <typename E>
std::string Describe(const EnumSpec<E>& s) {
  return ChoiceList(s.choices);
}
std::string Describe(const HeadersSpec&) { return "object of header name to string value"; }

}  // namespace

Status ParseKnob(const Knob& knob, const json& value, Options& options) {
  return std::visit([&](const auto& spec) { return Parse(spec, value, options); }, knob.spec);
}

Status CheckKnob(const Knob& knob, const Options& options) {
  return std::visit([&](const auto& spec) { return Check(spec, options); }, knob.spec);
}

std::string RenderKnob(const Knob& knob, const Options& options, bool redact) {
  return std::visit([&](const auto& spec) { return Render(spec, options, redact); }, knob.spec);
}

std::string DescribeType(const Knob& knob) {
  return std::visit([](const auto& spec) { return Describe(spec); }, knob.spec);
}

std::string DescribeJson(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean " + v.dump();
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "number " + v.dump();
    case json::value_t::string: {
      std::string s = v.dump();
      if (s.size() > 60) s = s.substr(0, 56) + "...\"";
      return "string " + s;
    }
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

}  // namespace ckptio::config
