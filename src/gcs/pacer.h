#pragma once
// UploadPacer: gcs.max_upload_bandwidth, the bytes per second all uploads of
// one storage root send together (a second tier's copies must not starve the
// trainer's input pipeline).
//
// A virtual clock: each request reserves its bytes, which occupy the link
// for bytes / rate from when the previous reservation's end; the request
// waits until its own start. Each request's own transfer is also capped at
// the rate (http::Request::max_send_speed), so no burst exceeds it either.
// Thread-safe: the lanes of one root share one.
#include <chrono>
#include <cstdint>
#include <mutex>

namespace ckptio::gcs {

class UploadPacer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit UploadPacer(uint64_t bytes_per_second) : rate_(bytes_per_second) {}
  uint64_t rate() const { return rate_; }
  // How long to wait, from `now`, before sending `bytes`.
  Clock::duration Reserve(Clock::time_point now, uint64_t bytes);

 private:
  const uint64_t rate_;
  std::mutex mu_;
  Clock::time_point free_at_{};  // guarded by mu_: when the reserved bytes are all sent
};

}  // namespace ckptio::gcs
