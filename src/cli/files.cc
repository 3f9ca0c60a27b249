#include "cli/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "runtime/unique_fd.h"

namespace ckptio::cli {
namespace {

using runtime::UniqueFd;

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

}  // namespace

Result<MappedFile> MappedFile::Open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, "open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + " is not a regular file");
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) return MappedFile(path, nullptr, 0);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap", path);
  return MappedFile(path, static_cast<const uint8_t*>(p), size);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { Unmap(); }

void MappedFile::Unmap() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
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
