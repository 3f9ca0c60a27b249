#pragma once
// Invariant checks for the fuzz targets. A parser that accepts an input must
// hand back something that obeys the format's rules; when it does not, the
// target aborts so that libFuzzer records the input as a crash, exactly as
// for a sanitizer report. (assert() would vanish under -DNDEBUG.)

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "base/status_macros.h"  // ckptio::internal::AsStatus
#include "ckptio/status.h"

namespace ckptio::fuzz {

[[noreturn]] inline void Fail(const char* file, int line, const char* condition,
                              std::string_view detail) {
  std::fprintf(stderr, "%s:%d: fuzz invariant violated: %s\n  %.*s\n", file, line, condition,
               static_cast<int>(detail.size()), detail.data());
  std::abort();
}

// A name that can never leave the directory it is joined to, checked here
// from first principles rather than with the code under test: not empty, not
// absolute, no NUL, no "." or ".." component.
inline bool IsConfinedRelativePath(std::string_view name) {
  if (name.empty() || name.front() == '/' || name.find('\0') != std::string_view::npos) {
    return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t slash = name.find('/', start);
    if (slash == std::string_view::npos) slash = name.size();
    if (name.substr(start, slash - start) == "..") return false;
    start = slash + 1;
  }
  return true;
}

// A plain file name: one path component, not "." or "..", no NUL.
inline bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

}  // namespace ckptio::fuzz

// FUZZ_CHECK(cond, detail): aborts with `detail` (a std::string) unless cond.
#define FUZZ_CHECK(cond, detail)                                          \
  do {                                                                    \
    if (!(cond)) ::ckptio::fuzz::Fail(__FILE__, __LINE__, #cond, (detail)); \
  } while (0)

// FUZZ_CHECK_OK(status_or_result, detail): aborts with the error's message.
#define FUZZ_CHECK_OK(expr, detail)                                                  \
  do {                                                                               \
    const auto& fuzz_r_ = (expr);                                                    \
    if (!fuzz_r_.ok()) {                                                             \
      ::ckptio::fuzz::Fail(__FILE__, __LINE__, #expr " is ok",                       \
                           std::string(detail) + ": " +                              \
                               ::ckptio::internal::AsStatus(fuzz_r_).ToString());    \
    }                                                                                \
  } while (0)
