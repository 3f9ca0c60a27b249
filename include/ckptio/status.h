#pragma once
// Status and Result<T>: expected failures (I/O, HTTP, bad input) as values.
//
// A Status is cheap when ok (an enum and an empty string). An error carries a
// code, the errno that caused it (0 if none), and a message that says what was
// being done, to which path or object: "cannot commit checkpoint 200 in
// /data/ckpt: rename /data/ckpt/checkpoint_200.tmp-1: No space left on device".
// Context is added outermost-first with WithContext() as the error travels up.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "ckptio/export.h"

namespace ckptio {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,    // bad usage, bad config, bad input from the caller
  kNotFound,           // a path, step or object that does not exist
  kAlreadyExists,      // e.g. saving a step that is already committed
  kFailedPrecondition, // the operation does not make sense in this state
  kCorruption,         // data failed validation (CRC, bounds, hostile header)
  kIoError,            // the OS or the network failed an operation
  kNoSpace,            // ENOSPC / EDQUOT
  kPermissionDenied,   // EACCES / EPERM / EROFS
  kUnavailable,        // transient: try again later
  kDeadlineExceeded,   // a timeout or deadline passed
  kCancelled,          // the work was abandoned on request
  kResourceExhausted,  // a configured bound was hit (e.g. on_busy: skip)
  kUnimplemented,      // the platform lacks a feature we need
  kInternal,           // a bug
};

// Short stable name of a code, e.g. "NoSpace".
CKPTIO_EXPORT const char* StatusCodeName(StatusCode code);

class [[nodiscard]] CKPTIO_EXPORT Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), sys_errno_(sys_errno), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // The errno behind this error, or 0.
  int sys_errno() const { return sys_errno_; }
  const std::string& message() const { return message_; }
  // "<CodeName>: <message>", or "OK".
  std::string ToString() const;

  // Returns this error with "context: " prepended to its message (ok stays ok).
  Status WithContext(std::string_view context) const&;
  Status WithContext(std::string_view context) &&;

  // Documents that an error is dropped on purpose.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  int sys_errno_ = 0;
  std::string message_;
};

CKPTIO_EXPORT Status InvalidArgumentError(std::string message);
CKPTIO_EXPORT Status NotFoundError(std::string message);
CKPTIO_EXPORT Status AlreadyExistsError(std::string message);
CKPTIO_EXPORT Status FailedPreconditionError(std::string message);
CKPTIO_EXPORT Status CorruptionError(std::string message);
CKPTIO_EXPORT Status IoError(std::string message);
CKPTIO_EXPORT Status UnavailableError(std::string message);
CKPTIO_EXPORT Status DeadlineExceededError(std::string message);
CKPTIO_EXPORT Status CancelledError(std::string message);
CKPTIO_EXPORT Status ResourceExhaustedError(std::string message);
CKPTIO_EXPORT Status UnimplementedError(std::string message);
CKPTIO_EXPORT Status InternalError(std::string message);

// The one place errno becomes a Status. `err` is a positive errno (a negative
// one, as io_uring returns it, is accepted too). Message: "<what> <path>:
// <strerror>", or "<what>: <strerror>" when path is empty.
CKPTIO_EXPORT Status ErrnoToStatus(int err, std::string_view what, std::string_view path = {});

// Thrown by Result<T>::value() on an error: reading a value that is not there
// is a bug, not an expected failure.
class CKPTIO_EXPORT BadResultAccess : public std::logic_error {
 public:
  explicit BadResultAccess(const Status& s)
      : std::logic_error("Result holds no value: " + s.ToString()) {}
};

// Result<T>: a T or an error Status, shaped like std::expected.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit on purpose
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = InternalError("Result constructed from an ok Status without a value");
  }
  template <typename U>
    requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
             !std::is_same_v<std::decay_t<U>, Status>)
  Result(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  T& value() & { Check(); return *value_; }
  const T& value() const& { Check(); return *value_; }
  T&& value() && { Check(); return std::move(*value_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void Check() const {
    if (!value_) throw BadResultAccess(status_);
  }
  std::optional<T> value_;
  Status status_;
};

}  // namespace ckptio
