#pragma once
// AsyncSemaphore and AsyncEvent: bound and sequence work between coroutines on
// one loop thread. Not thread-safe: every call happens on the loop thread.
// Waiters are resumed through Loop::Schedule (never inline from Release/Set),
// so a release deep inside one coroutine does not run another on its stack.

#include <cassert>
#include <coroutine>
#include <cstdint>

#include "runtime/loop.h"

namespace ckptio::runtime {

namespace detail {
inline void ResumeSoon(std::coroutine_handle<> h) {
  if (Loop* loop = Loop::Current()) {
    loop->Schedule(h);
  } else {
    h.resume();
  }
}
}  // namespace detail

// Counts permits; Acquire(n) waits until n are free. FIFO: a large request at
// the head is not overtaken by small ones, so it cannot starve.
class AsyncSemaphore {
 public:
  explicit AsyncSemaphore(int64_t permits) : available_(permits) {}
  AsyncSemaphore(const AsyncSemaphore&) = delete;
  AsyncSemaphore& operator=(const AsyncSemaphore&) = delete;

  class Awaiter {
   public:
    Awaiter(AsyncSemaphore* s, int64_t n) : sem_(s), n_(n) {}
    bool await_ready() { return sem_->TryAcquire(n_); }
    void await_suspend(std::coroutine_handle<> h) {
      handle_ = h;
      sem_->Enqueue(this);
    }
    void await_resume() const noexcept {}

   private:
    friend class AsyncSemaphore;
    AsyncSemaphore* sem_;
    int64_t n_;
    std::coroutine_handle<> handle_;
    Awaiter* next_ = nullptr;
  };

  // co_await sem.Acquire(n). REQUIRES: n <= the semaphore's total permits.
  Awaiter Acquire(int64_t n = 1) { return Awaiter(this, n); }
  bool TryAcquire(int64_t n = 1) {
    if (head_ != nullptr || available_ < n) return false;
    available_ -= n;
    return true;
  }
  void Release(int64_t n = 1) {
    available_ += n;
    while (head_ != nullptr && head_->n_ <= available_) {
      Awaiter* w = head_;
      head_ = w->next_;
      if (head_ == nullptr) tail_ = nullptr;
      available_ -= w->n_;
      detail::ResumeSoon(w->handle_);
    }
  }
  int64_t available() const { return available_; }
  bool has_waiters() const { return head_ != nullptr; }

  // Permits held for a scope: Release()d when it ends, whichever way.
  //   co_await sem.Acquire(); AsyncSemaphore::Held held(&sem);
  class Held {
   public:
    explicit Held(AsyncSemaphore* sem, int64_t n = 1) : sem_(sem), n_(n) {}
    ~Held() { sem_->Release(n_); }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;

   private:
    AsyncSemaphore* sem_;
    int64_t n_;
  };

 private:
  void Enqueue(Awaiter* w) {
    if (tail_ != nullptr) {
      tail_->next_ = w;
    } else {
      head_ = w;
    }
    tail_ = w;
  }

  int64_t available_;
  Awaiter* head_ = nullptr;
  Awaiter* tail_ = nullptr;
};

// A manual-reset event: Wait() suspends until Set(); Set() wakes all waiters.
class AsyncEvent {
 public:
  AsyncEvent() = default;
  AsyncEvent(const AsyncEvent&) = delete;
  AsyncEvent& operator=(const AsyncEvent&) = delete;

  class Awaiter {
   public:
    explicit Awaiter(AsyncEvent* e) : event_(e) {}
    bool await_ready() const { return event_->set_; }
    void await_suspend(std::coroutine_handle<> h) {
      handle_ = h;
      next_ = event_->waiters_;
      event_->waiters_ = this;
    }
    void await_resume() const noexcept {}

   private:
    friend class AsyncEvent;
    AsyncEvent* event_;
    std::coroutine_handle<> handle_;
    Awaiter* next_ = nullptr;
  };

  Awaiter Wait() { return Awaiter(this); }
  void Set() {
    set_ = true;
    Awaiter* w = waiters_;
    waiters_ = nullptr;
    while (w != nullptr) {
      Awaiter* next = w->next_;
      detail::ResumeSoon(w->handle_);
      w = next;
    }
  }
  void Reset() { set_ = false; }
  bool is_set() const { return set_; }

 private:
  bool set_ = false;
  Awaiter* waiters_ = nullptr;
};

}  // namespace ckptio::runtime
