#pragma once
// Task<T>: a lazy, move-only coroutine that produces a T or an exception.
//
// Lazy: the body does not run until the task is awaited (or handed to
// SyncWait / Loop::Run). Destroying a task that was never awaited destroys its
// frame and its by-value parameters.
//
// Awaiting uses a bool-returning await_suspend: the child is started inline and
// the parent suspends only if the child did not finish synchronously. g++ 12
// does not turn symmetric transfer into a guaranteed tail call at -O0 or under
// ASan, so a loop of many synchronous completions would grow the stack; this
// form does not (see STYLE.md). When the child finishes asynchronously, its
// final_suspend resumes the parent, so the resumer's stack grows only by the
// depth of the await chain.
//
// Thread: a task is resumed by one thread at a time; in ckptio that is the
// Loop thread. Task itself uses no atomics.

#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace ckptio {

template <typename T = void>
class Task;

namespace detail {

class TaskPromiseBase {
 public:
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <typename P>
    void await_suspend(std::coroutine_handle<P> h) noexcept {
      TaskPromiseBase& p = h.promise();
      // Nothing after this call may touch the frame: the parent may destroy it.
      if (p.parent_suspended_) p.continuation_.resume();
    }
    void await_resume() noexcept {}
  };

  std::suspend_always initial_suspend() noexcept { return {}; }
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { exception_ = std::current_exception(); }

  void set_continuation(std::coroutine_handle<> h) { continuation_ = h; }
  void set_parent_suspended() { parent_suspended_ = true; }
  void RethrowIfFailed() {
    if (exception_) std::rethrow_exception(exception_);
  }

 private:
  std::coroutine_handle<> continuation_;
  bool parent_suspended_ = false;
  std::exception_ptr exception_;
};

template <typename T>
class TaskPromise final : public TaskPromiseBase {
 public:
  Task<T> get_return_object() noexcept;
  template <typename U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& v) {
    value_.emplace(std::forward<U>(v));
  }
  T Take() {
    RethrowIfFailed();
    return std::move(*value_);
  }

 private:
  std::optional<T> value_;
};

template <>
class TaskPromise<void> final : public TaskPromiseBase {
 public:
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void Take() { RethrowIfFailed(); }
};

}  // namespace detail

template <typename T>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::TaskPromise<T>;
  using value_type = T;

  Task() = default;
  explicit Task(std::coroutine_handle<promise_type> h) : handle_(h) {}
  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  bool valid() const { return static_cast<bool>(handle_); }
  bool done() const { return !handle_ || handle_.done(); }

  // Awaiting a Task: see the file comment for why await_suspend returns bool.
  bool await_ready() const noexcept { return !handle_ || handle_.done(); }
  bool await_suspend(std::coroutine_handle<> parent) noexcept {
    handle_.promise().set_continuation(parent);
    handle_.resume();
    if (handle_.done()) return false;
    handle_.promise().set_parent_suspended();
    return true;
  }
  T await_resume() { return handle_.promise().Take(); }

  // For runners (SyncWait, Loop::Run, when_all): start or inspect directly.
  std::coroutine_handle<promise_type> handle() const { return handle_; }

 private:
  std::coroutine_handle<promise_type> handle_;
};

namespace detail {
template <typename T>
Task<T> TaskPromise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<TaskPromise<T>>::from_promise(*this));
}
inline Task<void> TaskPromise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<TaskPromise<void>>::from_promise(*this));
}
}  // namespace detail

}  // namespace ckptio
