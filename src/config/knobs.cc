#include "config/knobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "config/units.h"
#include "base/redact.h"

namespace ckptio::config {
namespace {

using json = nlohmann::ordered_json;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

// ---- Rules for string knobs ----

bool HasControlChar(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
}

Status CheckPrefix(std::string_view prefix) {
  // The prefix becomes one path component (local) or the start of an object
  // name after the root (GCS); a '/' would create nesting that listing and
  // pruning do not expect. Empty is fine: orbax-style bare step numbers.
  if (prefix.find('/') != std::string_view::npos) {
    return InvalidArgumentError("must not contain '/', got \"" + std::string(prefix) + "\"");
  }
  if (HasControlChar(prefix)) return InvalidArgumentError("must not contain control characters");
  // NAME_MAX is 255; leave room for a 20-digit step and ".tmp-<nonce>".
  if (prefix.size() > 200) return InvalidArgumentError("must be at most 200 bytes long");
  return Status::Ok();
}

Status CheckEndpoint(std::string_view url) {
  if (url.empty()) return Status::Ok();
  const size_t scheme_end = url.find("://");
  const std::string_view scheme = url.substr(0, scheme_end);
  const bool scheme_ok = scheme_end != std::string_view::npos &&
                         (scheme == "http" || scheme == "https");
  if (!scheme_ok || scheme_end + 3 == url.size() || HasControlChar(url) ||
      url.find(' ') != std::string_view::npos) {
    return InvalidArgumentError("expected an http:// or https:// URL such as "
                                "\"https://storage.googleapis.com\", got \"" +
                                std::string(url) + "\"");
  }
  return Status::Ok();
}

// "https://user:pass@host/x" -> "https://<redacted>@host/x": a proxy or
// emulator URL may carry credentials, and ToJson output ends up in logs.
std::string RedactUrlUserinfo(std::string_view url) {
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos) return std::string(url);
  const size_t host_at = scheme_end + 3;
  const size_t authority_end = std::min(url.find_first_of("/?#", host_at), url.size());
  const size_t at = url.substr(0, authority_end).rfind('@');
  if (at == std::string_view::npos || at < host_at) return std::string(url);
  return std::string(url.substr(0, host_at)) + "<redacted>" + std::string(url.substr(at));
}

Status CheckHttpVersion(std::string_view v) {
  if (v == "1.1" || v == "2") return Status::Ok();
  return InvalidArgumentError("expected \"1.1\" or \"2\", got \"" + std::string(v) + "\"");
}

Status CheckNoControlChars(std::string_view v) {
  if (HasControlChar(v)) return InvalidArgumentError("must not contain control characters");
  return Status::Ok();
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool IsTokenChar(char c) {  // RFC 9110 tchar
  return std::isalnum(static_cast<unsigned char>(c)) ||
         std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

Status CheckHeaders(const std::map<std::string, std::string>& headers) {
  // Set by the upload protocol for each request; overriding them would
  // corrupt uploads rather than tune them.
  static constexpr std::string_view kReserved[] = {
      "host", "content-length", "content-range", "content-type", "transfer-encoding",
      "x-goog-hash"};
  std::map<std::string, std::string> seen;  // lower-case name -> name as written
  for (const auto& [name, value] : headers) {
    const std::string quoted = "header \"" + name + "\"";
    if (name.empty() || !std::all_of(name.begin(), name.end(), IsTokenChar)) {
      return InvalidArgumentError(quoted + ": not a valid HTTP header name");
    }
    if (value.find_first_of(std::string_view("\r\n\0", 3)) != std::string::npos) {
      return InvalidArgumentError(quoted + ": value must not contain CR, LF or NUL");
    }
    const std::string lower = Lower(name);
    if (std::find(std::begin(kReserved), std::end(kReserved), lower) != std::end(kReserved)) {
      return InvalidArgumentError(quoted + " is set by ckptio on each request and cannot be "
                                  "overridden");
    }
    auto [it, inserted] = seen.emplace(lower, name);
    if (!inserted) {
      return InvalidArgumentError(quoted + " and header \"" + it->second +
                                  "\" are the same header (names are case-insensitive)");
    }
  }
  return Status::Ok();
}

Status CheckBarrierKind(std::string_view v) {
  if (v == "auto" || v == "storage" || v == "callback") return Status::Ok();
  return InvalidArgumentError("expected \"auto\", \"storage\" or \"callback\", got \"" + std::string(v) + "\"");
}

// ---- Enum choices ----

constexpr Choice<SnapshotMode> kSnapshotChoices[] = {
    {"\"copy\"", SnapshotMode::kCopy}, {"\"borrow\"", SnapshotMode::kBorrow}};
constexpr Choice<SnapshotCrc> kSnapshotCrcChoices[] = {
    {"\"background\"", SnapshotCrc::kBackground}, {"\"fused\"", SnapshotCrc::kFused}};
constexpr Choice<OnBusy> kOnBusyChoices[] = {
    {"\"wait\"", OnBusy::kWait}, {"\"skip\"", OnBusy::kSkip}};
constexpr Choice<Options::Io::Direct> kDirectChoices[] = {
    {"\"auto\"", Options::Io::Direct::kAuto},
    {"true", Options::Io::Direct::kOn},
    {"false", Options::Io::Direct::kOff}};

// ---- Row builders: keep the table below one row per knob ----

Knob Group(std::string_view path, std::string_view description) {
  return Knob{path, description, GroupSpec{}};
}
Knob Size(std::string_view path, Field<uint64_t> f, std::string_view description,
          uint64_t min, uint64_t max = std::numeric_limits<uint64_t>::max(),
          uint64_t multiple_of = 1, std::string_view why_multiple = {}) {
  return Knob{path, description, SizeSpec{f, min, max, multiple_of, why_multiple}};
}
// A size whose value 0 is written "auto".
Knob SizeOrAuto(std::string_view path, Field<uint64_t> f, std::string_view description, uint64_t min) {
  return Knob{path, description, SizeSpec{f, min, std::numeric_limits<uint64_t>::max(), 1, {}, true}};
}
Knob Int(std::string_view path, Field<int> f, std::string_view description, int min, int max) {
  return Knob{path, description, IntSpec<int>{f, min, max}};
}
Knob Int64(std::string_view path, Field<int64_t> f, std::string_view description, int64_t min,
           int64_t max) {
  return Knob{path, description, IntSpec<int64_t>{f, min, max}};
}
Knob Bool(std::string_view path, Field<bool> f, std::string_view description) {
  return Knob{path, description, BoolSpec{f}};
}
Knob String(std::string_view path, Field<std::string> f, std::string_view description,
            Status (*check)(std::string_view) = nullptr,
            std::string (*redact)(std::string_view) = nullptr) {
  return Knob{path, description, StringSpec{f, check, redact}};
}
Knob Duration(std::string_view path, Field<milliseconds> f, std::string_view description,
              milliseconds min) {
  return Knob{path, description, DurationSpec{f, min}};
}
template <typename E>
Knob Enum(std::string_view path, Field<E> f, std::string_view description,
          std::span<const Choice<E>> choices) {
  return Knob{path, description, EnumSpec<E>{f, choices}};
}
Knob Headers(std::string_view path, Field<std::map<std::string, std::string>> f,
             std::string_view description) {
  return Knob{path, description, HeadersSpec{f}};
}

// The key path is the member path itself, so the two cannot disagree.
#define CKPTIO_KNOB(member) #member, [](auto& o) -> auto& { return o.member; }

constexpr int kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

const std::vector<Knob>& Table() {
  static const std::vector<Knob> table = {
      SizeOrAuto(CKPTIO_KNOB(staging_memory),
           "Most bytes of staging memory saves copy into, reused by every save. \"auto\": grows to what "
           "the saves need, up to half the machine's memory. A size: pre-faulted in the background "
           "from the start. A save that needs more than this is written straight from the caller's "
           "buffers, and save() returns once it is written.", kMiB),
      Size(CKPTIO_KNOB(shard_size),
           "Max bytes of tensor data per shard file (a larger tensor gets a shard of its own).",
           1),
      Enum<SnapshotMode>(CKPTIO_KNOB(snapshot),
           "\"copy\": copy tensors into staging; \"borrow\": no copy, buffers must stay "
           "unchanged until the save ends.", kSnapshotChoices),
      Enum<SnapshotCrc>(CKPTIO_KNOB(snapshot_crc),
           "Copy mode: \"background\" computes CRC32C while shards are written (the trainer waits "
           "for the copy only); \"fused\" computes it during the copy.", kSnapshotCrcChoices),
      Enum<OnBusy>(CKPTIO_KNOB(on_busy),
           "When a save does not fit in free staging: \"wait\" for room, or \"skip\" the save "
           "and report it.", kOnBusyChoices),
      Int(CKPTIO_KNOB(max_in_flight), "Saves running in the background at once.", 1, 1024),
      Int(CKPTIO_KNOB(keep), "Committed checkpoints to keep; 0 keeps all.", 0, kIntMax),
      Int64(CKPTIO_KNOB(keep_every), "Every K-th step is kept forever; 0 = off.", 0, kInt64Max),
      String(CKPTIO_KNOB(prefix), "Directory / object name prefix of a step (may be empty).",
             CheckPrefix),
      Bool(CKPTIO_KNOB(overwrite),
           "Replace a committed checkpoint of the same step instead of failing."),
      Int(CKPTIO_KNOB(threads), "CPU pool workers; 0 = one per core.", 0, 4096),

      Group("io", "Local file writes (io_uring)."),
      Size(CKPTIO_KNOB(io.block_size), "Bytes per write request.", 4 * kKiB, kGiB, 4 * kKiB,
           "so that O_DIRECT writes stay aligned to the disk's blocks"),
      Int(CKPTIO_KNOB(io.queue_depth),
          "Writes in flight, all files together; borrowed tensors that are not 4 KiB-aligned go out "
          "O_DIRECT through this many bounce buffers of io.block_size (mapped once, reused).", 1, 4096),
      Enum<Options::Io::Direct>(CKPTIO_KNOB(io.direct),
           "O_DIRECT: \"auto\" tries it and falls back to buffered I/O where it is refused.",
           kDirectChoices),
      Bool(CKPTIO_KNOB(io.register_buffers),
           "Register staging buffers with io_uring (fixed buffers)."),
      Bool(CKPTIO_KNOB(io.recycle),
           "Write new shards into the files of pruned checkpoints (kept in <root>/.recycle) instead of "
           "deleting them and allocating new ones: up to one checkpoint's files more on disk."),

      Group("trace", "Tracing of the save pipeline."),
      String(CKPTIO_KNOB(trace.path), "Write a Chrome trace-event JSON file here; empty = off.",
             CheckNoControlChars),

      Group("gcs", "Google Cloud Storage (gs:// roots)."),
      String(CKPTIO_KNOB(gcs.endpoint),
             "Empty = $STORAGE_EMULATOR_HOST if set, else https://storage.googleapis.com.",
             CheckEndpoint, RedactUrlUserinfo),
      Size(CKPTIO_KNOB(gcs.chunk_size), "Bytes per resumable upload request.", 256 * kKiB,
           std::numeric_limits<uint64_t>::max(), 256 * kKiB,
           "GCS resumable uploads require it"),
      Int(CKPTIO_KNOB(gcs.connections), "HTTP connections shared by all uploads (split among gcs.loops).", 1, 1024),
      Int(CKPTIO_KNOB(gcs.loops),
          "Event-loop threads that carry shard uploads and reads, each with its own connections "
          "(TLS is CPU-bound: one thread tops out near one core); 1 = all on the manager's loop.",
          1, 64),
      Group("gcs.retry", "Retries of 408, 429, 5xx and transport errors."),
      Int(CKPTIO_KNOB(gcs.retry.max_attempts), "Attempts per request, the first included.", 1,
          1000),
      Duration(CKPTIO_KNOB(gcs.retry.initial_backoff), "Backoff before the first retry.",
               milliseconds(1)),
      Duration(CKPTIO_KNOB(gcs.retry.max_backoff), "Cap on the backoff, which doubles per retry.",
               milliseconds(1)),
      Duration(CKPTIO_KNOB(gcs.retry.deadline),
               "Give up on an object after this long. A metadata request (list, stat, delete, a small read or "
               "upload, a token fetch) ends within it, retries included: the worst case of `ckptio ls` when the "
               "endpoint never answers. A data transfer stops retrying at it; its attempt in flight runs until "
               "done or stalled for gcs.timeouts.stall.",
               milliseconds(1)),
      Group("gcs.timeouts", "Network timeouts."),
      Duration(CKPTIO_KNOB(gcs.timeouts.connect), "TCP + TLS connection set-up.",
               milliseconds(1)),
      Duration(CKPTIO_KNOB(gcs.timeouts.stall),
               "Abort an attempt that moves no bytes for this long (then retried, within gcs.retry).",
               milliseconds(1)),
      Headers(CKPTIO_KNOB(gcs.headers),
              "Extra headers on every request; values of secret-named headers and values that look like "
              "credentials (\"Bearer ...\", \"ya29.\", long tokens) are redacted when printed."),
      String(CKPTIO_KNOB(gcs.user_project),
             "Bill requests to this project (requester-pays buckets); empty = none.",
             CheckNoControlChars),
      String(CKPTIO_KNOB(gcs.http_version), "HTTP version: \"1.1\" or \"2\".", CheckHttpVersion),
      String(CKPTIO_KNOB(gcs.ca_file), "PEM file of CA certificates to trust for https; empty = the system's.",
             CheckNoControlChars),
      Bool(CKPTIO_KNOB(gcs.allow_http_credentials),
           "Send the access token to an http:// gcs.endpoint (anyone on the path could read it); "
           "false = only https, or an emulator via $STORAGE_EMULATOR_HOST, which gets no token."),

      Group("preemption", "Preemptible machines."),
      Bool(CKPTIO_KNOB(preemption.on_sigterm), "Save and exit when SIGTERM arrives."),
      Duration(CKPTIO_KNOB(preemption.grace), "Time the final save may take after SIGTERM.",
               milliseconds(0)),

      Group("multihost", "Many processes writing one checkpoint together; process 0 commits."),
      Int(CKPTIO_KNOB(multihost.process_index), "This process's index, in [0, process_count).", 0, 1 << 20),
      Int(CKPTIO_KNOB(multihost.process_count), "Processes writing each checkpoint.", 1, 1 << 20),
      String(CKPTIO_KNOB(multihost.barrier),
             "\"auto\", \"storage\" (poll the checkpoint location) or \"callback\" (the Barrier given to Open).",
             CheckBarrierKind),
      Duration(CKPTIO_KNOB(multihost.timeout), "A barrier that does not complete in this time fails the save.",
               milliseconds(1)),
  };
  return table;
}

#undef CKPTIO_KNOB

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

std::span<const Knob> Knobs() { return Table(); }

const Knob* FindKnob(std::string_view path) {
  for (const Knob& k : Table()) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

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

bool IsSecretValue(std::string_view name, std::string_view value) {
  return IsSecretHeader(name) || base::LooksLikeCredential(value);
}

bool IsSecretHeader(std::string_view name) {
  const std::string lower = Lower(name);
  static constexpr std::string_view kSecretWords[] = {
      "auth", "cookie", "token", "secret", "key", "password", "signature", "credential",
      "session"};
  return std::any_of(std::begin(kSecretWords), std::end(kSecretWords),
                     [&](std::string_view w) { return lower.find(w) != std::string::npos; });
}

}  // namespace ckptio::config
