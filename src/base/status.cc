#include "ckptio/status.h"

#include <cerrno>
#include <cstring>

namespace ckptio {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kNoSpace: return "NoSpace";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out = StatusCodeName(code_);
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const& {
  Status copy = *this;
  return std::move(copy).WithContext(context);
}

Status Status::WithContext(std::string_view context) && {
  if (!ok() && !context.empty()) {
    std::string m(context);
    m += ": ";
    m += message_;
    message_ = std::move(m);
  }
  return std::move(*this);
}

Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status AlreadyExistsError(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
Status FailedPreconditionError(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
Status CorruptionError(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status DeadlineExceededError(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
Status UnimplementedError(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

namespace {
StatusCode CodeForErrno(int err) {
  switch (err) {
    case ENOENT: case ENOTDIR: return StatusCode::kNotFound;
    case EEXIST: case ENOTEMPTY: return StatusCode::kAlreadyExists;
    case ENOSPC: case EDQUOT: return StatusCode::kNoSpace;
    case EACCES: case EPERM: case EROFS: return StatusCode::kPermissionDenied;
    case EINVAL: case ENAMETOOLONG: case EISDIR: return StatusCode::kInvalidArgument;
    case ECANCELED: return StatusCode::kCancelled;
    case ETIME: case ETIMEDOUT: return StatusCode::kDeadlineExceeded;
    case EAGAIN: case EBUSY: return StatusCode::kUnavailable;
    case ENOSYS: case EOPNOTSUPP: return StatusCode::kUnimplemented;
    case ENOMEM: return StatusCode::kResourceExhausted;
    default: return StatusCode::kIoError;
  }
}
}  // namespace

Status ErrnoToStatus(int err, std::string_view what, std::string_view path) {
  if (err < 0) err = -err;
  char buf[128];
  // GNU strerror_r returns the message (possibly not in buf).
  const char* text = strerror_r(err, buf, sizeof buf);
  std::string m(what);
  if (!path.empty()) {
    m += ' ';
    m += path;
  }
  m += ": ";
  m += text;
  return Status(CodeForErrno(err), std::move(m), err);
}

}  // namespace ckptio
