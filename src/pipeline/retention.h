#pragma once
// The keep policy, as a pure function.

#include <cstdint>
#include <set>
#include <vector>

namespace ckptio::pipeline {

// Which committed steps to delete: all but the newest `keep` and every step
// that is a multiple of `keep_every` (if > 0), never one in `untouchable`
// (saves in flight, checkpoints being read). keep == 0 keeps everything.
// Returns steps in ascending order.
std::vector<int64_t> StepsToPrune(const std::set<int64_t>& committed, int keep, int64_t keep_every,
                                  const std::set<int64_t>& untouchable);

}  // namespace ckptio::pipeline
