#include "gcs/retry.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "base/redact.h"

namespace ckptio::gcs {
namespace {

// GCS error bodies: {"error": {"code": 503, "message": "..."}}; fall back to
// the start of the body for anything else (an HTML page from a proxy). The
// credentials are redacted before the body is cut to 200 bytes, so that no
// prefix of one survives the cut (tokens are shorter than the 4 KiB more
// looked at).
std::string ServerMessage(const http::Response& r, std::span<const std::string> secrets) {
  auto j = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error")) {
    const auto& e = j["error"];
    if (e.is_object() && e.contains("message") && e["message"].is_string()) {
      return base::RedactCredentials(e["message"].get<std::string>(), secrets);
    }
    if (e.is_string()) return base::RedactCredentials(e.get<std::string>(), secrets);
  }
  std::string body =
      base::RedactCredentials(std::string_view(r.body).substr(0, 200 + 4096), secrets).substr(0, 200);
  for (char& c : body) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return body.empty() ? "(no message)" : body;
}

}  // namespace

Outcome Classify(const Result<http::Response>& result, std::string_view what,
                 std::span<const std::string> secrets) {
  if (!result.ok()) {
    StatusCode c = result.status().code();
    bool transient = c == StatusCode::kUnavailable || c == StatusCode::kDeadlineExceeded;
    return {result.status().WithContext(what), transient, false};
  }
  const long s = result->status;
  if ((s >= 200 && s < 300) || s == 308) return {Status::Ok(), false, false};
  std::string m = std::string(what) + ": HTTP " + std::to_string(s) + ": " + ServerMessage(*result, secrets);
  if (s == 408 || s == 429 || s >= 500) return {UnavailableError(std::move(m)), true, false};
  switch (s) {
    case 401: return {Status(StatusCode::kPermissionDenied, std::move(m)), false, true};
    case 403: return {Status(StatusCode::kPermissionDenied, std::move(m)), false, false};
    case 404: case 410: return {NotFoundError(std::move(m)), false, false};
    case 409: case 412: return {AlreadyExistsError(std::move(m)), false, false};
    case 400: case 411: case 413: case 416: return {InvalidArgumentError(std::move(m)), false, false};
    default: return {IoError(std::move(m)), false, false};
  }
}

Backoff::Backoff(const Options::Gcs::Retry& policy, Now now, uint64_t seed)
    : policy_(policy), now_(std::move(now)), start_(now_()), rng_(seed) {}

bool Backoff::Next(std::chrono::milliseconds* delay) {
  if (attempts_ >= policy_.max_attempts) return false;
  // Full jitter: uniform in [0, min(max, initial * 2^(attempt-1))].
  double cap = std::min<double>(static_cast<double>(policy_.max_backoff.count()),
                                static_cast<double>(policy_.initial_backoff.count()) * double(uint64_t{1} << std::min(attempts_ - 1, 30)));
  std::uniform_real_distribution<double> dist(0.0, cap);
  *delay = std::chrono::milliseconds(static_cast<int64_t>(dist(rng_)));
  auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(now_() - start_);
  if (elapsed + *delay >= policy_.deadline) return false;
  ++attempts_;
  return true;
}

std::string Backoff::Exhausted() const {
  auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(now_() - start_);
  const std::string max_attempts = "gcs.retry.max_attempts " + std::to_string(policy_.max_attempts);
  const std::string deadline = "gcs.retry.deadline " + std::to_string(policy_.deadline.count()) + " ms";
  const bool out_of_attempts = attempts_ >= policy_.max_attempts;
  return "gave up after " + std::to_string(attempts_) + (attempts_ == 1 ? " attempt" : " attempts") + " in " +
         std::to_string(elapsed.count()) + " ms: " + (out_of_attempts ? max_attempts : deadline) + " reached (" +
         (out_of_attempts ? deadline : max_attempts) + ")";
}

}  // namespace ckptio::gcs
