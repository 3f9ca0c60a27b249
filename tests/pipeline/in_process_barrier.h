#pragma once
// A Barrier for the processes of a multi-host save that are managers in this
// one process (threads): Wait() returns once `count` callers have waited on
// a name (each name of a save is waited on once per process); AllGather()
// does the same and returns every caller's bytes by process index.

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptio/barrier.h"

namespace ckptio::testing {

class InProcessRendezvous {
 public:
  explicit InProcessRendezvous(int count) : count_(count) {}
  Status Wait(const std::string& name, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    ++arrived_[name];
    cv_.notify_all();
    if (!cv_.wait_for(lock, timeout, [&] { return arrived_[name] >= count_; })) {
      return DeadlineExceededError("barrier \"" + name + "\" timed out");
    }
    return Status::Ok();
  }
  // `index` is the caller's process index (a callback is made per process).
  Result<std::vector<std::string>> AllGather(int index, const std::string& name, std::string bytes,
                                             std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    std::vector<std::string>& all = gathered_[name];
    all.resize(static_cast<size_t>(count_));
    all[static_cast<size_t>(index)] = std::move(bytes);
    ++arrived_["all-gather " + name];
    cv_.notify_all();
    if (!cv_.wait_for(lock, timeout, [&] { return arrived_["all-gather " + name] >= count_; })) {
      return DeadlineExceededError("all-gather \"" + name + "\" timed out");
    }
    return all;
  }

 private:
  const int count_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, int> arrived_;
  std::map<std::string, std::vector<std::string>> gathered_;
};

// Wait() only: the storage fallback exchanges nothing.
inline std::shared_ptr<Barrier> InProcessBarrier(int count) {
  auto rendezvous = std::make_shared<InProcessRendezvous>(count);
  return CallbackBarrier([rendezvous](const std::string& name, std::chrono::milliseconds timeout) {
    return rendezvous->Wait(name, timeout);
  });
}

// One barrier per process (the all-gather needs to know who calls), all
// meeting at the same rendezvous.
inline std::vector<std::shared_ptr<Barrier>> InProcessAllGatherBarriers(int count) {
  auto rendezvous = std::make_shared<InProcessRendezvous>(count);
  std::vector<std::shared_ptr<Barrier>> out;
  for (int p = 0; p < count; ++p) {
    out.push_back(CallbackBarrier(
        [rendezvous](const std::string& name, std::chrono::milliseconds timeout) {
          return rendezvous->Wait(name, timeout);
        },
        [rendezvous, p](const std::string& name, std::string bytes, std::chrono::milliseconds timeout) {
          return rendezvous->AllGather(p, name, std::move(bytes), timeout);
        }));
  }
  return out;
}

}  // namespace ckptio::testing
