#pragma once
// SigtermWatcher: turns a SIGTERM into a call on a thread of its own, where
// anything may be done (a signal handler may only write to an eventfd).
//
// One watcher per process at a time. Destroying it restores the previous
// disposition of SIGTERM. RaisePrevious() ends the handling the way the
// process would have without us: the previous handler, or death by SIGTERM.

#include <signal.h>

#include <functional>
#include <memory>
#include <thread>

#include "ckptio/status.h"
#include "base/unique_fd.h"

namespace ckptio::pipeline {

class SigtermWatcher {
 public:
  static Result<std::unique_ptr<SigtermWatcher>> Install(std::function<void()> on_sigterm);
  ~SigtermWatcher();
  SigtermWatcher(const SigtermWatcher&) = delete;
  SigtermWatcher& operator=(const SigtermWatcher&) = delete;

  // Restores the previous disposition and raises SIGTERM again.
  void RaisePrevious();

 private:
  SigtermWatcher() = default;
  static void Handler(int);
  void Main();

  std::function<void()> on_sigterm_;
  base::UniqueFd fd_;
  struct sigaction previous_ {};
  bool restored_ = false;
  std::thread thread_;
};

}  // namespace ckptio::pipeline
