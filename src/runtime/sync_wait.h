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

#include <coroutine>
#include <exception>
#include <optional>
#include <semaphore>
#include <type_traits>
#include <utility>

#include "runtime/task.h"
#include "runtime/when_all.h"

namespace ckptio {
namespace detail {

// A minimal eager-on-start coroutine whose completion calls a notifier.
class Notifier {
 public:
  virtual void Notify() noexcept = 0;

 protected:
  ~Notifier() = default;
};

template <typename T>
class RunnerTask {
 public:
  using Stored = std::conditional_t<std::is_void_v<T>, Void, T>;
  struct promise_type {
    Notifier* notifier = nullptr;
    std::optional<Stored> value;
    std::exception_ptr exception;
    RunnerTask get_return_object() noexcept {
      return RunnerTask(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct Final {
      bool await_ready() noexcept { return false; }
      void await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        h.promise().notifier->Notify();
      }
      void await_resume() noexcept {}
    };
    Final final_suspend() noexcept { return {}; }
    void unhandled_exception() noexcept { exception = std::current_exception(); }
    template <typename U>
    void return_value(U&& v) {
      value.emplace(std::forward<U>(v));
    }
  };
  explicit RunnerTask(std::coroutine_handle<promise_type> h) : h_(h) {}
  RunnerTask(RunnerTask&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  RunnerTask(const RunnerTask&) = delete;
  ~RunnerTask() {
    if (h_) h_.destroy();
  }
  void Start(Notifier* n) {
    h_.promise().notifier = n;
    h_.resume();
  }
  std::coroutine_handle<> handle() const { return h_; }
  void SetNotifier(Notifier* n) { h_.promise().notifier = n; }
  bool done() const { return h_.done(); }
  T Take() {
    if (h_.promise().exception) std::rethrow_exception(h_.promise().exception);
    if constexpr (!std::is_void_v<T>) return std::move(*h_.promise().value);
  }

 private:
  std::coroutine_handle<promise_type> h_;
};

template <typename T>
RunnerTask<T> MakeRunner(Task<T> task) {
  if constexpr (std::is_void_v<T>) {
    co_await task;
    co_return Void{};
  } else {
    co_return co_await task;
  }
}

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
