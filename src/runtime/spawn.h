#pragma once
// Spawn: start a Task<void> that nobody awaits (a background pipeline).

#include <coroutine>
#include <cstdio>
#include <exception>

#include "runtime/task.h"

namespace ckptio::runtime {
namespace detail {

struct DetachedTask {
  struct promise_type {
    DetachedTask get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }  // the frame frees itself
    void return_void() noexcept {}
    void unhandled_exception() noexcept {
      // Background tasks report expected failures as Status; an exception
      // escaping one is a bug, and there is nobody left to tell.
      try {
        throw;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ckptio: background task threw: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "ckptio: background task threw\n");
      }
      std::terminate();
    }
  };
};

inline DetachedTask RunDetached(Task<void> task) { co_await task; }

}  // namespace detail

// Starts `task` now, inline on the calling (loop) thread; its frame is freed
// when it finishes. The caller must keep whatever the task references alive
// until then (e.g. count spawned tasks and wait for the count to drop).
inline void Spawn(Task<void> task) { detail::RunDetached(std::move(task)); }

}  // namespace ckptio::runtime
