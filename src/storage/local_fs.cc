// LocalStorage's plain synchronous file-system helpers (local_internal.h).

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <linux/stat.h>  // STATX_DIOALIGN

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <random>

#include "storage/local_internal.h"

namespace ckptio::storage::local {
namespace {

// Only shards are recycled; manifests and fragments are small: deleted.
constexpr std::string_view kRecycledSuffix = ".safetensors";

// Moves the shard file `entry` of directory `fd` (root-relative `dir`) into
// kRecycleDir under the root `dirfd`. False if it is not a shard or the
// rename failed (the caller deletes it instead).
bool RecycleSync(int dirfd, int fd, const std::string& dir, const std::string& entry, FsObserver* observer,
                 std::vector<BinFile>* bin) {
  if (!std::string_view(entry).ends_with(kRecycledSuffix)) return false;
  struct stat st;
  // A file with another name (a backup made with hard links) must keep its
  // bytes: delete our name only.
  if (::fstatat(fd, entry.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
    return false;
  }
  if (::mkdirat(dirfd, kRecycleDir, 0755) == 0) {
    if (observer != nullptr) observer->MadeDir(kRecycleDir);
  } else if (errno != EEXIST) {
    return false;
  }
  // Into the bin itself, never through a link named like it: pruned data
  // must not leave the root.
  UniqueFd bin_dir(::openat(dirfd, kRecycleDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW));
  if (!bin_dir.valid()) return false;
  const std::string name = "r-" + Nonce();
  const std::string to = std::string(kRecycleDir) + "/" + name;
  if (::renameat2(fd, entry.c_str(), bin_dir.get(), name.c_str(), RENAME_NOREPLACE) != 0) return false;
  if (observer != nullptr) observer->Renamed(dir + "/" + entry, to, /*exchange=*/false);
  bin->push_back({name, static_cast<uint64_t>(st.st_size)});
  return true;
}

}  // namespace

std::string Nonce() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// A segment can go out with O_DIRECT if its memory and file offset are
// block-aligned and its length, rounded up to a block, fits its capacity.
size_t DirectMemoryAlign(int fd) {
  struct statx st {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) != 0 || (st.stx_mask & STATX_DIOALIGN) == 0) {
    return kDirectBlock;
  }
  const size_t a = st.stx_dio_mem_align;
  return a != 0 && (a & (a - 1)) == 0 && kDirectBlock % a == 0 ? a : kDirectBlock;
}

bool DirectEligible(const Segment& s) {
  return reinterpret_cast<uintptr_t>(s.data) % kDirectAlign == 0 && s.offset % kDirectAlign == 0 &&
         RoundUp(s.len, kDirectAlign) <= s.capacity;
}

// "a FIFO", "a directory", ...: what sits where a regular file should be.
std::string FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a regular file";
}

// An open of a path inside the root that failed, said plainly: the open
// follows no symbolic link and never leaves the root (OpenBeneath).
Status OpenFailed(const Status& s, const std::string& path) {
  switch (s.sys_errno()) {
    case ELOOP:
      return CorruptionError(path + ": a symbolic link where a checkpoint file or directory should be "
                                    "(ckptio follows no link inside a checkpoint root)");
    case EXDEV:
      return CorruptionError(path + ": leads outside the checkpoint root");
    case 0:
      return s;
    default:
      return ErrnoToStatus(s.sys_errno(), "open", path);
  }
}

// A failed operation renamed after the absolute `path` (io_uring ops name
// the root-relative path they were given), so messages say where.
Status At(Status s, std::string_view what, const std::string& path) {
  if (s.ok() || s.sys_errno() == 0) return s;
  return ErrnoToStatus(s.sys_errno(), what, path);
}


// Whether the recycled file open as `fd` is ours alone, so overwriting it
// harms nobody: no other name (hard link) and no other open file (a reader
// in another process that opened the pruned checkpoint before the prune,
// whose reads must go on seeing the old bytes). A write lease is granted
// only while no other open file refers to the inode; where leases are not
// supported (NFS), nothing is proven: false.
bool OnlyOpener(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) return false;
  if (::fcntl(fd, F_SETLEASE, F_WRLCK) != 0) return false;
  (void)::fcntl(fd, F_SETLEASE, F_UNLCK);
  return true;
}

// Deletes directory `name` under `dirfd` and the files in it (one level: a
// checkpoint has no subdirectories); with `recycled`, moves the files worth
// it into kRecycleDir instead and lists them there. Runs on a pool thread:
// plain syscalls.
Status RemoveTreeSync(int dirfd, const std::string& name, const std::string& root, FsObserver* observer,
                      std::vector<BinFile>* recycled) {
  int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return Status::Ok();
    return ErrnoToStatus(errno, "open", root + "/" + name);
  }
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return ErrnoToStatus(errno, "list", root + "/" + name);
  }
  Status status;
  while (dirent* e = ::readdir(dir)) {
    std::string entry = e->d_name;
    if (entry == "." || entry == "..") continue;
    if (recycled != nullptr && RecycleSync(dirfd, fd, name, entry, observer, recycled)) continue;
    if (::unlinkat(fd, entry.c_str(), 0) != 0) {
      if (errno != ENOENT && status.ok()) status = ErrnoToStatus(errno, "unlink", root + "/" + name + "/" + entry);
    } else if (observer != nullptr) {
      observer->Removed(name + "/" + entry);
    }
  }
  ::closedir(dir);
  if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0) {
    if (errno != ENOENT && status.ok()) status = ErrnoToStatus(errno, "rmdir", root + "/" + name);
  } else if (observer != nullptr) {
    observer->Removed(name);
  }
  return status;
}

Status RemoveExceptSync(int dirfd, const std::string& name, const std::vector<std::string>& keep,
                        const std::string& root, FsObserver* observer) {
  UniqueFd fd(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return errno == ENOENT ? Status::Ok() : ErrnoToStatus(errno, "open", root + "/" + name);
  // The manifest first, durably: from here on the step is not committed.
  if (::unlinkat(fd.get(), "manifest.json", 0) == 0) {
    if (observer != nullptr) observer->Removed(name + "/manifest.json");
    if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync", root + "/" + name);
    if (observer != nullptr) observer->Synced(name);
  } else if (errno != ENOENT) {
    return ErrnoToStatus(errno, "unlink", root + "/" + name + "/manifest.json");
  }
  int listed = ::dup(fd.get());
  DIR* dir = listed < 0 ? nullptr : ::fdopendir(listed);
  if (dir == nullptr) {
    if (listed >= 0) ::close(listed);
    return ErrnoToStatus(errno, "list", root + "/" + name);
  }
  Status status;
  while (dirent* e = ::readdir(dir)) {
    std::string entry = e->d_name;
    if (entry == "." || entry == ".." || std::find(keep.begin(), keep.end(), entry) != keep.end()) continue;
    if (::unlinkat(fd.get(), entry.c_str(), 0) != 0) {
      if (errno != ENOENT && status.ok()) status = ErrnoToStatus(errno, "unlink", root + "/" + name + "/" + entry);
    } else if (observer != nullptr) {
      observer->Removed(name + "/" + entry);
    }
  }
  ::closedir(dir);
  return status;
}

Result<UniqueFd> LockRootSync(int root_fd, const std::string& root) {
  const std::string path = root + "/.ckptio.lock";
  UniqueFd fd(::openat(root_fd, ".ckptio.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644));
  if (!fd.valid()) {
    if (errno == ELOOP) {
      return FailedPreconditionError(path + " is a symbolic link: ckptio follows no link inside a checkpoint "
                                            "root (remove it; ckptio creates the lock file itself)");
    }
    return ErrnoToStatus(errno, "open", path);
  }
  struct stat lock_st;
  if (::fstat(fd.get(), &lock_st) != 0) return ErrnoToStatus(errno, "stat", path);
  if (!S_ISREG(lock_st.st_mode)) {
    return FailedPreconditionError(path + " is " + FileKind(lock_st.st_mode) +
                                   ", not the lock file ckptio creates (remove it)");
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return FailedPreconditionError("another process is writing checkpoints to " + root +
                                     " (it holds the lock " + path + ")");
    }
    return ErrnoToStatus(errno, "lock", path);
  }
  return fd;
}

std::vector<BinFile> ListBinSync(int root_fd) {
  std::vector<BinFile> bin;
  int bin_fd = ::openat(root_fd, kRecycleDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  if (bin_fd < 0) return bin;
  DIR* dir = ::fdopendir(bin_fd);
  if (dir == nullptr) {
    ::close(bin_fd);
    return bin;
  }
  while (dirent* e = ::readdir(dir)) {
    struct stat st;
    if (e->d_name[0] == '.' || ::fstatat(bin_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
      continue;
    }
    bin.push_back({e->d_name, static_cast<uint64_t>(st.st_size)});
  }
  ::closedir(dir);
  return bin;
}

}  // namespace ckptio::storage::local
