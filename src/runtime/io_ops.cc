#include "runtime/io_ops.h"

#include <algorithm>
#include <climits>

namespace ckptio::runtime {
namespace {
// One submission moves at most this much; the kernel caps a single read or
// write near 2 GiB anyway, and io_uring's length field is 32 bits.
constexpr size_t kMaxChunk = size_t{1} << 30;
}  // namespace

void ReadOp::Prep(io_uring_sqe* sqe) {
  unsigned n = static_cast<unsigned>(std::min(len_ - done_, kMaxChunk));
  if (fixed_ >= 0) {
    io_uring_prep_read_fixed(sqe, file_->fd(), buf_ + done_, n, off_ + done_, fixed_);
    loop_->NoteFixedOp();
  } else {
    io_uring_prep_read(sqe, file_->fd(), buf_ + done_, n, off_ + done_);
  }
}

bool ReadOp::OnResult(int res) {
  if (Transient(res)) return false;
  if (res < 0) {
    err_ = -res;
    return true;
  }
  done_ += static_cast<size_t>(res);
  return res == 0 || done_ == len_;  // 0: end of file
}

void ReadVOp::Prep(io_uring_sqe* sqe) {
  // Skip empty buffers (io_uring would return 0 for them, read as end of file).
  while (first_ < n_ && iov_[first_].iov_len == 0) ++first_;
  const auto n = static_cast<unsigned>(std::min<size_t>(n_ - first_, IOV_MAX));
  io_uring_prep_readv(sqe, file_->fd(), iov_ + first_, n, off_ + done_);
}

bool ReadVOp::OnResult(int res) {
  if (Transient(res)) return false;
  if (res < 0) {
    err_ = -res;
    return true;
  }
  done_ += static_cast<size_t>(res);
  for (auto left = static_cast<size_t>(res); left > 0 && first_ < n_; ++first_) {
    if (left < iov_[first_].iov_len) {  // a buffer filled in part: resume inside it
      iov_[first_].iov_base = static_cast<char*>(iov_[first_].iov_base) + left;
      iov_[first_].iov_len -= left;
      break;
    }
    left -= iov_[first_].iov_len;
  }
  while (first_ < n_ && iov_[first_].iov_len == 0) ++first_;
  return res == 0 || first_ == n_;  // 0: end of file
}

void WriteOp::Prep(io_uring_sqe* sqe) {
  unsigned n = static_cast<unsigned>(std::min(len_ - done_, kMaxChunk));
  if (fixed_ >= 0) {
    io_uring_prep_write_fixed(sqe, file_->fd(), buf_ + done_, n, off_ + done_, fixed_);
    loop_->NoteFixedOp();
  } else {
    io_uring_prep_write(sqe, file_->fd(), buf_ + done_, n, off_ + done_);
  }
}

bool WriteOp::OnResult(int res) {
  if (Transient(res)) return false;
  if (res < 0) {
    err_ = -res;
    return true;
  }
  if (res == 0 && len_ > 0) {  // no progress and no error: report rather than spin
    err_ = EIO;
    return true;
  }
  done_ += static_cast<size_t>(res);
  return done_ == len_;
}

}  // namespace ckptio::runtime
