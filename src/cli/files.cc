#include "cli/files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "base/status_macros.h"
#include "base/unique_fd.h"

namespace ckptio::cli {
namespace {

using base::UniqueFd;

// Big writes are split so progress moves and a signal never waits on one
// multi-GiB write.
constexpr size_t kWriteChunk = size_t{16} << 20;

Status WriteAll(int fd, const std::string& path, std::span<const std::byte> bytes, uint64_t* done, uint64_t total,
                const WriteProgressFn& progress) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), std::min(bytes.size(), kWriteChunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "write", path);
    bytes = bytes.subspan(static_cast<size_t>(n));
    *done += static_cast<uint64_t>(n);
    if (progress) progress(*done, total);
  }
  return Status::Ok();
}

std::string DirectoryOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Status FsyncDirectory(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, "open directory", dir);
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync directory", dir);
  return Status::Ok();
}

Status WriteTmp(const std::string& tmp, std::span<const std::span<const std::byte>> pieces,
                const WriteProgressFn& progress) {
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoToStatus(errno, "create", tmp);
  uint64_t total = 0;
  uint64_t done = 0;
  for (const auto& p : pieces) total += p.size();
  for (const auto& p : pieces) RETURN_IF_ERROR(WriteAll(fd.get(), tmp, p, &done, total, progress));
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync", tmp);
  if (::close(fd.release()) != 0) return ErrnoToStatus(errno, "close", tmp);
  return Status::Ok();
}

// The live mappings, for the SIGBUS handler: fixed slots it can read
// without locks or allocation (async-signal-safe).
struct MappingSlot {
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  char path[512] = {};
};
constexpr size_t kMappingSlots = 256;
MappingSlot g_mappings[kMappingSlots];
std::mutex g_mappings_mu;  // serializes Register/Unregister (never the handler)

void WriteStderr(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void OnSigbus(int sig, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (const MappingSlot& m : g_mappings) {
    const uintptr_t begin = m.begin.load(std::memory_order_acquire);
    if (begin != 0 && addr >= begin && addr < m.end.load(std::memory_order_acquire)) {
      WriteStderr("ckptio: ");
      WriteStderr(m.path);
      WriteStderr(" shrank while it was being read (truncated by another process?): nothing was committed\n");
      ::_exit(1);  // kExitUsage: the input is not what it was
    }
  }
  // Not one of our inputs: a real fault. Crash as the default action would.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Returns the slot of [data, data + size) for Unregister, or -1 if all are
// taken (the mapping then goes unprotected: a SIGBUS stays a crash).
int RegisterMapping(const std::string& path, const uint8_t* data, size_t size) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, nullptr);
  });
  std::lock_guard lock(g_mappings_mu);
  for (size_t i = 0; i < kMappingSlots; ++i) {
    MappingSlot& m = g_mappings[i];
    if (m.begin.load() != 0) continue;
    std::snprintf(m.path, sizeof m.path, "%s", path.c_str());
    m.end.store(reinterpret_cast<uintptr_t>(data) + size, std::memory_order_release);
    m.begin.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void UnregisterMapping(int slot) {
  if (slot < 0) return;
  std::lock_guard lock(g_mappings_mu);
  g_mappings[slot].begin.store(0, std::memory_order_release);
}

}  // namespace

Result<MappedFile> MappedFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) return ErrnoToStatus(errno, "open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + " is not a regular file");
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) return MappedFile(path, nullptr, 0);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap", path);
  MappedFile file(path, static_cast<const uint8_t*>(p), size);
  file.slot_ = RegisterMapping(path, file.data_, size);
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      slot_(std::exchange(other.slot_, -1)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

MappedFile::~MappedFile() { Unmap(); }

void MappedFile::Unmap() {
  UnregisterMapping(std::exchange(slot_, -1));
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

constexpr size_t kDirectBuffer = size_t{8} << 20;
constexpr size_t kDirectAlign = 4096;

Result<AtomicFile> AtomicFile::Create(const std::string& path, Mode mode) {
  const std::string tmp = path + ".tmp";
  const int direct_flag = mode == Mode::kAppend ? O_DIRECT : 0;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | direct_flag, 0644);
  const bool direct = fd >= 0 && direct_flag != 0;
  if (!direct && errno == EINVAL) fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, "create", tmp);
  AtomicFile file(path, fd);
  if (direct) {
    void* p = nullptr;
    if (::posix_memalign(&p, kDirectAlign, kDirectBuffer) != 0) return ResourceExhaustedError("cannot allocate " + std::to_string(kDirectBuffer) + " bytes to write " + tmp);
    file.buffer_ = static_cast<std::byte*>(p);
  }
  return file;
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : path_(std::move(other.path_)), tmp_(std::move(other.tmp_)), fd_(std::exchange(other.fd_, -1)),
      size_(other.size_), buffer_(std::exchange(other.buffer_, nullptr)), buffered_(other.buffered_),
      written_(other.written_) {}

AtomicFile::~AtomicFile() {
  std::free(buffer_);
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());  // best effort; the error that stopped the write is the one reported
}

Status AtomicFile::Flush(size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pwrite(fd_, buffer_ + done, len - done, static_cast<off_t>(written_ + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "write", tmp_);
    done += static_cast<size_t>(n);
  }
  written_ += len;
  return Status::Ok();
}

Status AtomicFile::Append(std::span<const std::byte> bytes) {
  size_ += bytes.size();
  if (buffer_ == nullptr) {
    uint64_t done = 0;
    return WriteAll(fd_, tmp_, bytes, &done, bytes.size(), {});
  }
  while (!bytes.empty()) {
    const size_t n = std::min(bytes.size(), kDirectBuffer - buffered_);
    std::memcpy(buffer_ + buffered_, bytes.data(), n);
    buffered_ += n;
    bytes = bytes.subspan(n);
    if (buffered_ == kDirectBuffer) {
      RETURN_IF_ERROR(Flush(kDirectBuffer));
      buffered_ = 0;
    }
  }
  return Status::Ok();
}

Status AtomicFile::WriteAt(uint64_t offset, std::span<const std::byte> bytes) {
  if (buffer_ != nullptr) return InternalError("WriteAt on " + tmp_ + ", a file opened to append");
  size_ = std::max(size_, offset + bytes.size());
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "write", tmp_);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status AtomicFile::Commit() {
  if (buffer_ != nullptr && buffered_ > 0) {
    // The last block goes out padded; the file is cut back to its size.
    const size_t padded = (buffered_ + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::memset(buffer_ + buffered_, 0, padded - buffered_);
    RETURN_IF_ERROR(Flush(padded));
    buffered_ = 0;
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) return ErrnoToStatus(errno, "truncate", tmp_);
  }
  if (::fsync(fd_) != 0) return ErrnoToStatus(errno, "fsync", tmp_);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    ::unlink(tmp_.c_str());
    return ErrnoToStatus(errno, "close", tmp_);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    Status s = ErrnoToStatus(errno, "rename " + tmp_ + " to", path_);
    ::unlink(tmp_.c_str());
    return s;
  }
  // The rename is durable only once the directory is.
  return FsyncDirectory(DirectoryOf(path_));
}

Status WriteFileAtomically(const std::string& path, std::span<const std::span<const std::byte>> pieces,
                           const WriteProgressFn& progress) {
  const std::string tmp = path + ".tmp";
  Status s = WriteTmp(tmp, pieces, progress);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoToStatus(errno, "rename " + tmp + " to", path);
  if (!s.ok()) {
    ::unlink(tmp.c_str());  // best effort; the write error is the one to report
    return s;
  }
  // The rename is durable only once the directory is.
  return FsyncDirectory(DirectoryOf(path));
}

}  // namespace ckptio::cli
