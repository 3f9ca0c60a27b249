#include "pipeline/retention.h"

namespace ckptio::pipeline {

std::vector<int64_t> StepsToPrune(const std::set<int64_t>& committed, int keep, int64_t keep_every,
                                  const std::set<int64_t>& untouchable) {
  std::vector<int64_t> out;
  if (keep <= 0) return out;
  int newer = 0;  // committed steps newer than the one being considered
  for (auto it = committed.rbegin(); it != committed.rend(); ++it, ++newer) {
    int64_t step = *it;
    if (newer < keep) continue;
    if (keep_every > 0 && step % keep_every == 0) continue;
    if (untouchable.count(step) != 0) continue;
    out.insert(out.begin(), step);
  }
  return out;
}

}  // namespace ckptio::pipeline
