#pragma once
// WhenAll: await many tasks at once.
//
//   std::vector<T> r = co_await WhenAll(std::move(vector_of_tasks));
//   auto [a, b]     = co_await WhenAll(TaskA(), TaskB());
//
// Every child is started inline, in order, on the awaiting thread; the parent
// resumes once all have finished (a counter started at count + 1, as in
// cppcoro, so children that finish synchronously never resume the parent
// early). If any child threw, the first exception (in argument order) is
// rethrown after all children have finished. Void results become Void{} in
// the tuple form.

#include <coroutine>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <vector>

#include "runtime/runner.h"
#include "runtime/task.h"

namespace ckptio {

namespace detail {

// Counts the children down (from count + 1) and resumes the parent at zero.
struct WhenAllState final : Notifier {
  explicit WhenAllState(size_t children) : remaining(children + 1) {}
  // Returns true iff this was the last outstanding arrival.
  bool Arrive() { return --remaining == 0; }
  void Notify() noexcept override {
    if (Arrive()) parent.resume();
  }
  size_t remaining;
  std::coroutine_handle<> parent;
};

template <typename T>
using WhenAllChild = RunnerTask<T>;

// Starts children via `start(state)`, suspends unless all finished inline.
template <typename StartAll>
class WhenAllAwaiter {
 public:
  WhenAllAwaiter(WhenAllState* state, StartAll start) : state_(state), start_(start) {}
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> parent) {
    state_->parent = parent;
    start_(state_);
    return !state_->Arrive();
  }
  void await_resume() const noexcept {}

 private:
  WhenAllState* state_;
  StartAll start_;
};

}  // namespace detail

template <typename T>
auto WhenAll(std::vector<Task<T>> tasks)
    -> Task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> {
  std::vector<detail::WhenAllChild<T>> children;
  children.reserve(tasks.size());
  for (auto& t : tasks) children.push_back(detail::MakeRunner<T>(std::move(t)));
  detail::WhenAllState state(children.size());
  auto start = [&children](detail::WhenAllState* s) {
    for (auto& c : children) c.Start(s);
  };
  detail::WhenAllAwaiter<decltype(start)> awaiter(&state, start);
  co_await awaiter;
  for (auto& c : children) c.RethrowIfFailed();
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> out;
    out.reserve(children.size());
    for (auto& c : children) out.push_back(c.TakeStored());
    co_return out;
  }
}

template <typename... Ts>
auto WhenAll(Task<Ts>... tasks)
    -> Task<std::tuple<typename detail::WhenAllChild<Ts>::Stored...>> {
  std::tuple<detail::WhenAllChild<Ts>...> children(detail::MakeRunner<Ts>(std::move(tasks))...);
  detail::WhenAllState state(sizeof...(Ts));
  auto start = [&children](detail::WhenAllState* s) {
    std::apply([s](auto&... c) { (c.Start(s), ...); }, children);
  };
  detail::WhenAllAwaiter<decltype(start)> awaiter(&state, start);
  co_await awaiter;
  std::apply([](auto&... c) { (c.RethrowIfFailed(), ...); }, children);
  co_return std::apply([](auto&... c) { return std::make_tuple(c.TakeStored()...); }, children);
}

}  // namespace ckptio
