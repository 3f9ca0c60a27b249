#pragma once
// Which failures are worth retrying, and how long to wait before the next try.

#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "gcs/clock.h"
#include "http/http_client.h"

namespace ckptio::gcs {

struct Outcome {
  Status status;           // OK for 2xx and 308
  bool retryable = false;  // 408, 429, 5xx, resets, timeouts
  bool unauthorized = false;  // 401: refresh the token once and try again
};

// The one function that turns an HTTP result into a Status and a verdict.
// `what` names the operation and object ("upload gs://b/o"); the message
// adds the HTTP status and the server's own error message, never a header.
// A server may echo the request in its message: `secrets` (the credentials
// the request carried) and anything that looks like a bearer token are
// redacted from it first.
Outcome Classify(const Result<http::Response>& result, std::string_view what,
                 std::span<const std::string> secrets = {});

// Capped exponential backoff with full jitter, bounded by attempts and a
// deadline. Not thread-safe; one per operation.
class Backoff {
 public:
  // `now` and `seed` are for tests: a clock they move themselves, and the
  // jitter's seed.
  explicit Backoff(const Options::Gcs::Retry& policy, Now now = std::chrono::steady_clock::now,
                   uint64_t seed = std::random_device{}());
  // True if another attempt is allowed; sets *delay to wait first.
  bool Next(std::chrono::milliseconds* delay);
  int attempts() const { return attempts_; }
  // Why Next() said no, to append to the last error: the attempts, the time
  // and which knob ran out (gcs.retry.max_attempts or gcs.retry.deadline).
  std::string Exhausted() const;
  // When gcs.retry.deadline runs out, counted from this object's creation.
  std::chrono::steady_clock::time_point deadline() const { return start_ + policy_.deadline; }

 private:
  Options::Gcs::Retry policy_;
  Now now_;
  std::chrono::steady_clock::time_point start_;
  int attempts_ = 1;  // the first attempt is made before any Next()
  std::mt19937_64 rng_;
};

}  // namespace ckptio::gcs
