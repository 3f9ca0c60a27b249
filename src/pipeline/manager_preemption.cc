// ManagerImpl on a preemptible machine: SIGTERM stops new saves, lets the
// ones in flight commit, runs the final-save callback within the grace
// period, says what was committed, then lets SIGTERM take its course.

#include <cstdio>

#include "pipeline/manager_impl.h"

namespace ckptio::pipeline {

void ManagerImpl::SetFinalSave(std::function<void(CheckpointManager&)> fn) {
  std::lock_guard lock(mu_);
  final_save_ = std::move(fn);
}

bool ManagerImpl::preempted() const {
  std::lock_guard lock(mu_);
  return preempting_;
}

bool ManagerImpl::WaitIdleUntil(std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
  return cv_.wait_until(lock, deadline, [this] { return in_flight_ == 0; });
}

void ManagerImpl::HandleSigterm() {
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + options_.preemption.grace;
  std::function<void(CheckpointManager&)> final_save;
  std::set<int64_t> before;
  {
    std::unique_lock lock(mu_);
    preempting_ = true;
    before = committed_;
    WaitIdleUntil(lock, deadline);  // let the saves in flight commit
    final_save = final_save_;
    final_save_thread_ = std::this_thread::get_id();
  }
  if (final_save && Clock::now() < deadline) final_save(*public_);
  std::set<int64_t> in_flight;
  std::set<int64_t> committed;
  {
    std::unique_lock lock(mu_);
    final_save_thread_ = {};
    WaitIdleUntil(lock, deadline);
    in_flight = in_flight_steps_;
    committed = committed_;
  }
  std::string now_committed;
  for (int64_t s : committed) {
    if (before.count(s) == 0) now_committed += (now_committed.empty() ? "" : ", ") + std::to_string(s);
  }
  std::string abandoned;
  for (int64_t s : in_flight) abandoned += (abandoned.empty() ? "" : ", ") + std::to_string(s);
  std::fprintf(stderr,
               "ckptio: SIGTERM: committed since: %s; latest committed step: %s; abandoned (not committed): %s; "
               "%.2f s of %.2f s grace\n",
               now_committed.empty() ? "none" : now_committed.c_str(),
               committed.empty() ? "none" : std::to_string(*committed.rbegin()).c_str(),
               abandoned.empty() ? "none" : abandoned.c_str(), std::chrono::duration<double>(Clock::now() - start).count(),
               std::chrono::duration<double>(options_.preemption.grace).count());
  std::fflush(stderr);
  sigterm_->RaisePrevious();
}

}  // namespace ckptio::pipeline
