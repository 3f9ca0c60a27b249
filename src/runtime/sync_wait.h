#pragma once
// SyncWait(task): run a task from ordinary code and block until it finishes.
//
// The task starts inline on the calling thread. If it suspends, the calling
// thread blocks until whichever thread resumes it (a Loop thread) finishes it.
// Returns the task's value or rethrows its exception.
//
// Do not use this for a task whose first step touches a Loop owned by another
// thread: use Loop::Run on the loop's own thread, Loop::BlockOn() from another
// thread, or OnLoop() (runtime/loop.h) from a coroutine on another loop.

#include <semaphore>

#include "runtime/runner.h"
#include "runtime/task.h"
#include "runtime/when_all.h"

namespace ckptio {
namespace detail {

class SemaphoreNotifier final : public Notifier {
 public:
  void Notify() noexcept override { sem_.release(); }
  void Wait() { sem_.acquire(); }

 private:
  std::binary_semaphore sem_{0};
};

}  // namespace detail

template <typename T>
T SyncWait(Task<T> task) {
  detail::SemaphoreNotifier done;
  auto runner = detail::MakeRunner<T>(std::move(task));
  runner.Start(&done);
  done.Wait();
  return runner.Take();
}

}  // namespace ckptio
