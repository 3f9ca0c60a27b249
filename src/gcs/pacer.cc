#include "gcs/pacer.h"

#include <algorithm>

namespace ckptio::gcs {

UploadPacer::Clock::duration UploadPacer::Reserve(Clock::time_point now, uint64_t bytes) {
  const auto takes = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / static_cast<double>(rate_)));
  std::lock_guard lock(mu_);
  const Clock::time_point start = std::max(free_at_, now);
  free_at_ = start + takes;
  return start - now;
}

}  // namespace ckptio::gcs
