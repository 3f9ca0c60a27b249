#pragma once
// The awaitable io_uring operations of Loop.
//
// Each operation object is its own IoOp: its address is the SQE's user_data,
// it lives in the awaiting coroutine's frame for the duration of the await, and
// it retries inside itself (EINTR, EAGAIN, short reads and writes) before it
// resumes the coroutine once, with a Status or Result naming the operation and
// the path. REQUIRES: created and awaited on the loop thread, in the same full
// expression (see Loop).

#include <fcntl.h>
#include <linux/openat2.h>
#include <linux/time_types.h>
#include <sys/uio.h>

#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <string>

#include "ckptio/status.h"
#include "runtime/loop.h"

namespace ckptio::runtime {

// CRTP base: Derived provides Prep(sqe) and OnResult(res) -> bool finished.
template <typename Derived>
class UringOp : public IoOp {
 public:
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    waiter_ = h;
    Submit();
  }

 protected:
  explicit UringOp(Loop& loop) : loop_(&loop) { complete = &Dispatch; }
  UringOp(const UringOp&) = delete;
  UringOp& operator=(const UringOp&) = delete;

  static bool Transient(int res) { return res == -EINTR || res == -EAGAIN; }

  Loop* loop_;

 private:
  void Submit() {
    io_uring_sqe* sqe = loop_->GetSqe();
    static_cast<Derived*>(this)->Prep(sqe);
    loop_->Arm(sqe, this);
  }
  static void Dispatch(IoOp* op, int res, uint32_t) {
    auto* self = static_cast<Derived*>(op);
    if (self->OnResult(res)) {
      self->waiter_.resume();
    } else {
      self->Submit();
    }
  }
  std::coroutine_handle<> waiter_;
};

// An operation that completes once with a plain result (retrying EINTR/EAGAIN).
template <typename Derived>
class SimpleOp : public UringOp<Derived> {
 public:
  bool OnResult(int res) {
    if (this->Transient(res)) return false;
    res_ = res;
    return true;
  }

 protected:
  using UringOp<Derived>::UringOp;
  int res_ = 0;
};

class OpenAtOp final : public SimpleOp<OpenAtOp> {
 public:
  OpenAtOp(Loop& l, int dirfd, const std::string& path, int flags, mode_t mode)
      : SimpleOp(l), dirfd_(dirfd), path_(&path), flags_(flags | O_CLOEXEC), mode_(mode) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_openat(sqe, dirfd_, path_->c_str(), flags_, mode_); }
  Result<File> await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "open", *path_);
    return File(UniqueFd(res_), *path_);
  }

 private:
  int dirfd_;
  const std::string* path_;
  int flags_;
  mode_t mode_;
};

// openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS:
// `path` is resolved inside `dirfd` without following a symbolic link at any
// component (ELOOP) or leaving `dirfd` through ".." (EXDEV).
class OpenBeneathOp final : public SimpleOp<OpenBeneathOp> {
 public:
  OpenBeneathOp(Loop& l, int dirfd, const std::string& path, int flags, mode_t mode)
      : SimpleOp(l), dirfd_(dirfd), path_(&path) {
    how_.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
    how_.mode = (flags & O_CREAT) != 0 ? mode : 0;  // openat2 refuses a mode it will not use
    how_.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  }
  void Prep(io_uring_sqe* sqe) { io_uring_prep_openat2(sqe, dirfd_, path_->c_str(), &how_); }
  Result<File> await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "open", *path_);
    return File(UniqueFd(res_), *path_);
  }

 private:
  int dirfd_;
  const std::string* path_;
  open_how how_{};
};

class CloseOp final : public SimpleOp<CloseOp> {
 public:
  CloseOp(Loop& l, File& file) : SimpleOp(l), file_(&file), fd_(file.release()) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_close(sqe, fd_); }
  // A close is never retried: the descriptor is gone even when close fails.
  bool OnResult(int res) {
    res_ = res;
    return true;
  }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "close", file_->path());
    return Status::Ok();
  }

 private:
  File* file_;
  int fd_;
};

// Reads until `len` bytes or end of file; returns the bytes read.
class ReadOp final : public UringOp<ReadOp> {
 public:
  ReadOp(Loop& l, const File& f, void* buf, size_t len, uint64_t off)
      : UringOp(l), file_(&f), buf_(static_cast<char*>(buf)), len_(len), off_(off),
        fixed_(l.FindFixedBuffer(buf, len)) {}
  void Prep(io_uring_sqe* sqe);
  bool OnResult(int res);
  Result<size_t> await_resume() {
    if (err_ != 0) return ErrnoToStatus(err_, "read", file_->path());
    return done_;
  }

 private:
  const File* file_;
  char* buf_;
  size_t len_;
  uint64_t off_;
  int fixed_;
  size_t done_ = 0;
  int err_ = 0;
};

// Reads into the buffers of iov[0, n) in turn from `off` (preadv), until they
// are full or end of file; returns the bytes read. Advances the iovecs past
// what a short read filled, so the array must be writable and outlive the op.
class ReadVOp final : public UringOp<ReadVOp> {
 public:
  ReadVOp(Loop& l, const File& f, struct iovec* iov, size_t n, uint64_t off)
      : UringOp(l), file_(&f), iov_(iov), n_(n), off_(off) {}
  void Prep(io_uring_sqe* sqe);
  bool OnResult(int res);
  Result<size_t> await_resume() {
    if (err_ != 0) return ErrnoToStatus(err_, "read", file_->path());
    return done_;
  }

 private:
  const File* file_;
  struct iovec* iov_;
  size_t n_;
  uint64_t off_;
  size_t first_ = 0;  // iov_[first_] is the next buffer with room
  size_t done_ = 0;
  int err_ = 0;
};

// Writes all `len` bytes (resubmitting after short writes).
class WriteOp final : public UringOp<WriteOp> {
 public:
  WriteOp(Loop& l, const File& f, const void* buf, size_t len, uint64_t off)
      : UringOp(l), file_(&f), buf_(static_cast<const char*>(buf)), len_(len), off_(off),
        fixed_(l.FindFixedBuffer(buf, len)) {}
  void Prep(io_uring_sqe* sqe);
  bool OnResult(int res);
  Status await_resume() {
    if (err_ != 0) return ErrnoToStatus(err_, "write", file_->path());
    return Status::Ok();
  }

 private:
  const File* file_;
  const char* buf_;
  size_t len_;
  uint64_t off_;
  int fixed_;
  size_t done_ = 0;
  int err_ = 0;
};

class FsyncOp final : public SimpleOp<FsyncOp> {
 public:
  FsyncOp(Loop& l, const File& f, bool datasync) : SimpleOp(l), file_(&f), datasync_(datasync) {}
  void Prep(io_uring_sqe* sqe) {
    io_uring_prep_fsync(sqe, file_->fd(), datasync_ ? IORING_FSYNC_DATASYNC : 0);
  }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, datasync_ ? "fdatasync" : "fsync", file_->path());
    return Status::Ok();
  }

 private:
  const File* file_;
  bool datasync_;
};

class FallocateOp final : public SimpleOp<FallocateOp> {
 public:
  FallocateOp(Loop& l, const File& f, int mode, uint64_t off, uint64_t len)
      : SimpleOp(l), file_(&f), mode_(mode), off_(off), len_(len) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_fallocate(sqe, file_->fd(), mode_, off_, len_); }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "fallocate", file_->path());
    return Status::Ok();
  }

 private:
  const File* file_;
  int mode_;
  uint64_t off_;
  uint64_t len_;
};

class StatxOp final : public SimpleOp<StatxOp> {
 public:
  StatxOp(Loop& l, int dirfd, const std::string& path, int flags, unsigned mask)
      : SimpleOp(l), dirfd_(dirfd), path_(&path), flags_(flags), mask_(mask) {}
  void Prep(io_uring_sqe* sqe) {
    io_uring_prep_statx(sqe, dirfd_, path_->c_str(), flags_, mask_, &buf_);
  }
  Result<struct statx> await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "stat", *path_);
    return buf_;
  }

 private:
  int dirfd_;
  const std::string* path_;
  int flags_;
  unsigned mask_;
  struct statx buf_ {};
};

class MkdirAtOp final : public SimpleOp<MkdirAtOp> {
 public:
  MkdirAtOp(Loop& l, int dirfd, const std::string& path, mode_t mode)
      : SimpleOp(l), dirfd_(dirfd), path_(&path), mode_(mode) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_mkdirat(sqe, dirfd_, path_->c_str(), mode_); }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "mkdir", *path_);
    return Status::Ok();
  }

 private:
  int dirfd_;
  const std::string* path_;
  mode_t mode_;
};

class RenameAtOp final : public SimpleOp<RenameAtOp> {
 public:
  RenameAtOp(Loop& l, int olddirfd, const std::string& oldpath, int newdirfd,
             const std::string& newpath, unsigned flags)
      : SimpleOp(l), olddirfd_(olddirfd), oldpath_(&oldpath), newdirfd_(newdirfd),
        newpath_(&newpath), flags_(flags) {}
  void Prep(io_uring_sqe* sqe) {
    io_uring_prep_renameat(sqe, olddirfd_, oldpath_->c_str(), newdirfd_, newpath_->c_str(), flags_);
  }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "rename", *oldpath_ + " to " + *newpath_);
    return Status::Ok();
  }

 private:
  int olddirfd_;
  const std::string* oldpath_;
  int newdirfd_;
  const std::string* newpath_;
  unsigned flags_;
};

class UnlinkAtOp final : public SimpleOp<UnlinkAtOp> {
 public:
  UnlinkAtOp(Loop& l, int dirfd, const std::string& path, int flags)
      : SimpleOp(l), dirfd_(dirfd), path_(&path), flags_(flags) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_unlinkat(sqe, dirfd_, path_->c_str(), flags_); }
  Status await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, (flags_ & AT_REMOVEDIR) ? "rmdir" : "unlink", *path_);
    return Status::Ok();
  }

 private:
  int dirfd_;
  const std::string* path_;
  int flags_;
};

// One-shot poll; returns the ready events.
class PollOp final : public SimpleOp<PollOp> {
 public:
  PollOp(Loop& l, int fd, unsigned mask) : SimpleOp(l), fd_(fd), mask_(mask) {}
  void Prep(io_uring_sqe* sqe) { io_uring_prep_poll_add(sqe, fd_, mask_); }
  Result<unsigned> await_resume() {
    if (res_ < 0) return ErrnoToStatus(res_, "poll fd " + std::to_string(fd_));
    return static_cast<unsigned>(res_);
  }

 private:
  int fd_;
  unsigned mask_;
};

class SleepOp final : public UringOp<SleepOp> {
 public:
  SleepOp(Loop& l, std::chrono::nanoseconds d) : UringOp(l) {
    ts_.tv_sec = d.count() / 1'000'000'000;
    ts_.tv_nsec = d.count() % 1'000'000'000;
  }
  void Prep(io_uring_sqe* sqe) { io_uring_prep_timeout(sqe, &ts_, 0, 0); }
  bool OnResult(int res) {
    res_ = res;
    return true;
  }
  // OK when the time passed; Cancelled if the timer was cancelled.
  Status await_resume() {
    if (res_ == -ETIME || res_ == 0) return Status::Ok();
    return ErrnoToStatus(res_, "sleep");
  }

 private:
  __kernel_timespec ts_{};
  int res_ = 0;
};

inline OpenAtOp Loop::OpenAt(int dirfd, const std::string& path, int flags, mode_t mode) {
  return OpenAtOp(*this, dirfd, path, flags, mode);
}
inline OpenBeneathOp Loop::OpenBeneath(int dirfd, const std::string& path, int flags, mode_t mode) {
  return OpenBeneathOp(*this, dirfd, path, flags, mode);
}
inline CloseOp Loop::Close(File& file) { return CloseOp(*this, file); }
inline ReadOp Loop::Read(const File& f, void* buf, size_t len, uint64_t off) {
  return ReadOp(*this, f, buf, len, off);
}
inline ReadVOp Loop::ReadV(const File& f, struct iovec* iov, size_t n, uint64_t off) {
  return ReadVOp(*this, f, iov, n, off);
}
inline WriteOp Loop::Write(const File& f, const void* buf, size_t len, uint64_t off) {
  return WriteOp(*this, f, buf, len, off);
}
inline FsyncOp Loop::Fsync(const File& f, bool datasync) { return FsyncOp(*this, f, datasync); }
inline FallocateOp Loop::Fallocate(const File& f, int mode, uint64_t off, uint64_t len) {
  return FallocateOp(*this, f, mode, off, len);
}
inline StatxOp Loop::Statx(int dirfd, const std::string& path, int flags, unsigned mask) {
  return StatxOp(*this, dirfd, path, flags, mask);
}
inline MkdirAtOp Loop::MkdirAt(int dirfd, const std::string& path, mode_t mode) {
  return MkdirAtOp(*this, dirfd, path, mode);
}
inline RenameAtOp Loop::RenameAt(int olddirfd, const std::string& oldpath, int newdirfd,
                                 const std::string& newpath, unsigned flags) {
  return RenameAtOp(*this, olddirfd, oldpath, newdirfd, newpath, flags);
}
inline UnlinkAtOp Loop::UnlinkAt(int dirfd, const std::string& path, int flags) {
  return UnlinkAtOp(*this, dirfd, path, flags);
}
inline PollOp Loop::Poll(int fd, unsigned mask) { return PollOp(*this, fd, mask); }
inline SleepOp Loop::Sleep(std::chrono::nanoseconds d) { return SleepOp(*this, d); }

}  // namespace ckptio::runtime
