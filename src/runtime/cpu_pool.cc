#include "runtime/cpu_pool.h"

#include <pthread.h>

#include <atomic>
#include <latch>

namespace ckptio::runtime {

CpuPool::CpuPool(size_t threads, std::string name) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    workers_.emplace_back([this, name] {
      pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
      WorkerMain();
    });
  }
}

CpuPool::~CpuPool() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void CpuPool::Enqueue(Job* job, bool urgent) {
  job->next = nullptr;
  {
    std::lock_guard lock(mu_);
    if (urgent && head_ != nullptr) {
      job->next = head_;  // in front; the tail stays where it is
      head_ = job;
    } else if (tail_ != nullptr) {
      tail_->next = job;
      tail_ = job;
    } else {
      head_ = tail_ = job;
    }
  }
  cv_.notify_one();
}

size_t CpuPool::queued() {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (Job* j = head_; j != nullptr; j = j->next) ++n;
  return n;
}

void CpuPool::WorkerMain() {
  for (;;) {
    Job* job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return head_ != nullptr || stopping_; });
      if (head_ == nullptr) return;  // stopping and drained
      job = head_;
      head_ = job->next;
      if (head_ == nullptr) tail_ = nullptr;
    }
    job->run(job);
  }
}

void CpuPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn, size_t max_helpers) {
  if (n == 0) return;
  std::atomic<size_t> next{0};
  auto drain = [&] {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  };
  // Helpers on the workers; the caller works too, so this makes progress even
  // when every worker is busy with something else.
  const size_t helpers = std::min({n - 1, workers_.size(), max_helpers});
  struct Helper : Job {
    decltype(drain)* work;
    std::latch* done;
  };
  std::latch done(static_cast<std::ptrdiff_t>(helpers));
  std::vector<Helper> jobs(helpers);
  for (Helper& h : jobs) {
    h.work = &drain;
    h.done = &done;
    h.run = [](Job* j) {
      auto* self = static_cast<Helper*>(j);
      (*self->work)();
      self->done->count_down();
    };
    Enqueue(&h, /*urgent=*/true);
  }
  drain();
  done.wait();
}

}  // namespace ckptio::runtime
