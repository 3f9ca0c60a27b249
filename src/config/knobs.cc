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

}  // namespace

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

namespace {

Status CheckBarrierKind(std::string_view v) {
  if (v == "auto" || v == "storage" || v == "callback") return Status::Ok();
  return InvalidArgumentError("expected \"auto\", \"storage\" or \"callback\", got \"" + std::string(v) + "\"");
}

// ---- Enum choices ----

constexpr Choice<SnapshotMode> kSnapshotChoices[] = {
    {"\"copy\"", SnapshotMode::kCopy}, {"\"borrow\"", SnapshotMode::kBorrow},
    {"\"background\"", SnapshotMode::kBackground}};
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
           "unchanged until the save ends; \"background\": copy on a ckptio thread after save() "
           "returns, buffers must stay unchanged until wait_snapshot().", kSnapshotChoices),
      Enum<SnapshotCrc>(CKPTIO_KNOB(snapshot_crc),
           "Copy mode: \"background\" computes CRC32C while shards are written (the trainer waits "
           "for the copy only); \"fused\" computes it during the copy.", kSnapshotCrcChoices),
      Enum<OnBusy>(CKPTIO_KNOB(on_busy),
           "When a save does not fit in free staging or max_in_flight saves are running: \"wait\" "
           "for room, or \"skip\" the save and report it (one process only: refused when "
           "multihost.process_count > 1).", kOnBusyChoices),
      Int(CKPTIO_KNOB(max_in_flight), "Saves running in the background at once.", 1, 1024),
      Int(CKPTIO_KNOB(keep), "Committed checkpoints to keep; 0 keeps all.", 0, kIntMax),
      Int64(CKPTIO_KNOB(keep_every), "Every K-th step is kept forever; 0 = off.", 0, kInt64Max),
      String(CKPTIO_KNOB(prefix), "Directory / object name prefix of a step (may be empty).",
             CheckPrefix),
      Bool(CKPTIO_KNOB(overwrite),
           "Replace a committed checkpoint of the same step instead of failing."),
      Bool(CKPTIO_KNOB(incremental),
           "Write only the tensors whose bytes changed since the last committed step (XXH3-128 "
           "content hash and CRC32C); the others point into the earlier step's shards, kept while "
           "referenced. Not with overwrite or multihost."),
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
      Size(CKPTIO_KNOB(gcs.max_upload_bandwidth),
           "Bytes per second all uploads of the root send together, e.g. \"100MiB\" (with two tiers: the "
           "copies to the remote tier, so that they leave the trainer's input pipeline its share); 0 = no cap.",
           0),
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

      Group("tiers", "Two tiers: the root is the local tier; committed steps are copied to a remote one."),
      String(CKPTIO_KNOB(tiers.remote),
             "gs://bucket/prefix or a directory: every remote_every-th committed step is copied there in the "
             "background; reads take the newest step of either tier. Empty = one tier.",
             CheckNoControlChars),
      Int64(CKPTIO_KNOB(tiers.remote_every), "Copy every N-th committed step (by step number) to the remote tier.",
            1, kInt64Max),
      Int(CKPTIO_KNOB(tiers.remote_keep), "Checkpoints the remote tier keeps; 0 keeps all.", 0, kIntMax),
      Int64(CKPTIO_KNOB(tiers.remote_keep_every), "Every K-th step is kept forever in the remote tier; 0 = off.", 0,
            kInt64Max),
      Bool(CKPTIO_KNOB(tiers.seed_local),
           "At open, when the remote tier has a newer step than the local one (a new machine), copy it into "
           "the local tier in the background."),
  };
  return table;
}

#undef CKPTIO_KNOB

}  // namespace

std::span<const Knob> Knobs() { return Table(); }

const Knob* FindKnob(std::string_view path) {
  for (const Knob& k : Table()) {
    if (k.path == path) return &k;
  }
  return nullptr;
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
