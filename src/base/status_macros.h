#pragma once
// RETURN_IF_ERROR / ASSIGN_OR_RETURN / CO_TRY / CO_ASSIGN_OR_RETURN: early
// returns on a failed Status or Result, which keep ckptio's own code (and
// coroutines) flat. Private to ckptio: the public status.h carries no macros.

#include <utility>

#include "ckptio/status.h"

namespace ckptio {
namespace internal {
inline const Status& AsStatus(const Status& s) { return s; }
inline Status AsStatus(Status&& s) { return std::move(s); }
template <typename T>
const Status& AsStatus(const Result<T>& r) { return r.status(); }
template <typename T>
Status AsStatus(Result<T>&& r) { return std::move(r).status(); }
}  // namespace internal
}  // namespace ckptio

#define CKPTIO_CONCAT_INNER(a, b) a##b
#define CKPTIO_CONCAT(a, b) CKPTIO_CONCAT_INNER(a, b)

// RETURN_IF_ERROR(expr): expr is a Status or a Result; returns its error.
#define RETURN_IF_ERROR(expr)                                                 \
  do {                                                                        \
    auto&& ckptio_try_ = (expr);                                              \
    if (!ckptio_try_.ok())                                                    \
      return ::ckptio::internal::AsStatus(std::move(ckptio_try_));            \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): expr is a Result<T>; assigns its value to lhs
// (which may be a declaration) or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  CKPTIO_ASSIGN_OR_RETURN_IMPL(CKPTIO_CONCAT(ckptio_res_, __LINE__), lhs, expr, return)

// The coroutine forms: CO_TRY(co_await f()); CO_ASSIGN_OR_RETURN(auto x, co_await g());
#define CO_TRY(expr)                                                          \
  do {                                                                        \
    auto&& ckptio_try_ = (expr);                                              \
    if (!ckptio_try_.ok())                                                    \
      co_return ::ckptio::internal::AsStatus(std::move(ckptio_try_));         \
  } while (0)

#define CO_ASSIGN_OR_RETURN(lhs, expr) \
  CKPTIO_ASSIGN_OR_RETURN_IMPL(CKPTIO_CONCAT(ckptio_res_, __LINE__), lhs, expr, co_return)

#define CKPTIO_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr, ret) \
  auto tmp = (expr);                                      \
  if (!tmp.ok()) ret std::move(tmp).status();             \
  lhs = std::move(tmp).value()
