#pragma once
// ProgressBar: a one-line progress bar on stderr, for work that takes long.
//
// Disabled (every call a no-op) unless stderr is a terminal, so logs and
// pipes get plain lines only, never carriage returns or escape codes.
// Update() is thread-safe and throttled to ~10 redraws a second: the
// manager's ProgressFn calls it from its loop thread once per piece read,
// which can be hundreds of times a second.

#include <cstdint>
#include <mutex>
#include <string>

#include "ckptio/checkpoint_manager.h"
#include "cli/common.h"

namespace ckptio::cli {

class ProgressBar {
 public:
  // `label` heads the line ("verify step 200"). enabled: draw at all.
  explicit ProgressBar(std::string label, bool enabled = StderrIsTerminal());
  // Clears the line if Finish() was not called.
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Any thread. Redraws if ~100 ms passed since the last redraw.
  void Update(uint64_t done, uint64_t total);
  // Erases the bar so the caller's final line starts clean. Any thread.
  void Finish();
  // A ProgressFn forwarding to Update(); valid while this bar lives.
  ProgressFn AsProgressFn();

  bool enabled() const { return enabled_; }

 private:
  void Draw(uint64_t done, uint64_t total);  // REQUIRES: mu_ held

  const std::string label_;
  const bool enabled_;
  const Clock::time_point start_;
  std::mutex mu_;
  Clock::time_point last_draw_;  // guarded by mu_
  bool drawn_ = false;           // guarded by mu_
  bool finished_ = false;        // guarded by mu_; no redraw after Finish()
};

}  // namespace ckptio::cli
