#pragma once
// RunnerTask: the one promise type that every "run a Task from outside"
// helper is built on (SyncWait, Loop::Run, Loop::BlockOn, OnLoop, WhenAll).
//
// A runner wraps a Task<T>, starts suspended, and when the task finishes
// (value or exception) calls its Notifier from the final suspend point. The
// notifier decides what "finished" means: release a semaphore, set a flag,
// post back to another loop, or count down a WhenAll.

#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "runtime/task.h"

namespace ckptio {

// Stands for the result of a Task<void> where a value is needed (WhenAll's tuple).
struct Void {};

namespace detail {

class Notifier {
 public:
  // Called on the thread that finished the task, from its final suspend
  // point: the runner may be destroyed as soon as this returns (or earlier,
  // by whoever the notifier wakes).
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
      void await_suspend(std::coroutine_handle<promise_type> h) noexcept { h.promise().notifier->Notify(); }
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

  // Resumes the task inline on this thread; `n` is called when it finishes.
  void Start(Notifier* n) {
    h_.promise().notifier = n;
    h_.resume();
  }
  // For a runner that another thread resumes through handle().
  void SetNotifier(Notifier* n) { h_.promise().notifier = n; }
  std::coroutine_handle<> handle() const { return h_; }

  void RethrowIfFailed() const {
    if (h_.promise().exception) std::rethrow_exception(h_.promise().exception);
  }
  // The task's result (Void{} for a void task). Call RethrowIfFailed first.
  Stored TakeStored() { return std::move(*h_.promise().value); }
  // The task's result, or its exception rethrown.
  T Take() {
    RethrowIfFailed();
    if constexpr (!std::is_void_v<T>) return TakeStored();
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

}  // namespace detail
}  // namespace ckptio
