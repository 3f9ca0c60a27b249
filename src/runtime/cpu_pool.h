#pragma once
// CpuPool: worker threads for CPU-bound work (copies, CRC32C, serialization).
//
//   R r = co_await pool.Run(fn);   // on a loop thread: fn runs on a worker,
//                                  // the coroutine resumes on the loop thread
//   pool.ParallelFor(n, fn);       // from any thread: fn(0..n-1) on the
//                                  // workers and the caller; blocks until done
//
// Jobs are intrusive: the awaiter (living in the coroutine frame) is the queue
// node and the post-back node, so Run() allocates nothing.
// Thread-safety: Run's awaiter must be awaited on a thread running a Loop;
// Enqueue and ParallelFor may be called from any thread.

#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "runtime/when_all.h"
#include "runtime/loop.h"

namespace ckptio::runtime {

class CpuPool {
 public:
  struct Job {
    void (*run)(Job* self) = nullptr;
    Job* next = nullptr;
  };

  // threads == 0 means one per online CPU.
  explicit CpuPool(size_t threads = 0, std::string name = "ckptio-cpu");
  ~CpuPool();  // REQUIRES: no job queued or running.
  CpuPool(const CpuPool&) = delete;
  CpuPool& operator=(const CpuPool&) = delete;

  size_t size() const { return workers_.size(); }

  // Thread-safe. The job runs on a worker; the caller keeps it alive until
  // then. An urgent job goes to the front of the queue (a trainer waiting on
  // a snapshot comes before background checksums).
  void Enqueue(Job* job, bool urgent = false);

  template <typename F>
  class RunAwaiter;
  // Awaitable: runs fn() on a worker, resumes the awaiting coroutine on its
  // loop thread with fn's result (or exception). Name the callable before the
  // co_await if it has non-trivial members (g++ 12, see STYLE.md).
  template <typename F>
  RunAwaiter<std::decay_t<F>> Run(F&& fn) {
    return RunAwaiter<std::decay_t<F>>(this, std::forward<F>(fn));
  }

  // Runs fn(i) for every i in [0, n) on up to max_helpers workers (default:
  // all) plus the calling thread, and returns when all calls have returned.
  // Its jobs are urgent. fn must not throw.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn, size_t max_helpers = SIZE_MAX);

  // Jobs waiting for a worker (for tests and stats).
  size_t queued();

 private:
  void WorkerMain();

  std::mutex mu_;
  std::condition_variable cv_;
  Job* head_ = nullptr;  // guarded by mu_
  Job* tail_ = nullptr;  // guarded by mu_
  bool stopping_ = false;  // guarded by mu_
  std::vector<std::thread> workers_;
};

template <typename F>
class CpuPool::RunAwaiter final : Job, PostNode {
 public:
  using R = std::invoke_result_t<F&>;

  RunAwaiter(CpuPool* pool, F fn) : pool_(pool), fn_(std::move(fn)) {
    Job::run = &RunOnWorker;
    PostNode::run = &ResumeOnLoop;
  }
  RunAwaiter(const RunAwaiter&) = delete;

  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    waiter_ = h;
    loop_ = Loop::Current();
    pool_->Enqueue(static_cast<Job*>(this));
  }
  R await_resume() {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<R>) return std::move(*result_);
  }

 private:
  static void RunOnWorker(Job* job) {
    auto* self = static_cast<RunAwaiter*>(job);
    try {
      if constexpr (std::is_void_v<R>) {
        self->fn_();
      } else {
        self->result_.emplace(self->fn_());
      }
    } catch (...) {
      self->error_ = std::current_exception();
    }
    self->loop_->Post(static_cast<PostNode*>(self));
  }
  static void ResumeOnLoop(PostNode* node) { static_cast<RunAwaiter*>(node)->waiter_.resume(); }

  CpuPool* pool_;
  F fn_;
  Loop* loop_ = nullptr;
  std::coroutine_handle<> waiter_;
  std::optional<std::conditional_t<std::is_void_v<R>, Void, R>> result_;
  std::exception_ptr error_;
};

}  // namespace ckptio::runtime
