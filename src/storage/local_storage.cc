#include "storage/local_storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string_view>

#include "ckptio/when_all.h"
#include "runtime/block_writer.h"
#include "runtime/io_ops.h"
#include "storage/direct_plan.h"

namespace ckptio::storage {
namespace {

using runtime::File;
using runtime::Loop;
using runtime::UniqueFd;

constexpr size_t kDirectAlign = kDirectBlock;

std::atomic<FsObserver*> g_observer{nullptr};

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

std::string Nonce() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// A segment can go out with O_DIRECT if its memory and file offset are
// block-aligned and its length, rounded up to a block, fits its capacity.
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

// Where Prune keeps the files it recycles (a hidden name: List skips it).
constexpr const char* kRecycleDir = ".recycle";
// Only shards are recycled; manifests and fragments are small: deleted.
constexpr std::string_view kRecycledSuffix = ".safetensors";

// A file in kRecycleDir.
struct BinFile {
  std::string name;
  uint64_t size = 0;
};

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
                      std::vector<BinFile>* recycled = nullptr) {
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

class LocalStorage;

class LocalWriter final : public CheckpointWriter {
 public:
  LocalWriter(LocalStorage* storage, std::string name, std::string tmp_name, File tmp_dir, bool replace, bool shared)
      : storage_(storage), name_(std::move(name)), tmp_name_(std::move(tmp_name)),
        tmp_dir_(std::move(tmp_dir)), replace_(replace), shared_(shared) {}
  ~LocalWriter() override;

  Task<Status> WriteFile(const FileImage* image) override;
  Task<Status> WriteSmall(std::string name, std::string bytes) override;
  Task<Result<std::string>> ReadSmall(std::string name, uint64_t max_bytes) override;
  Task<Status> Commit(std::string manifest_json) override;
  Task<Status> Abort() override;

 private:
  Task<Result<File>> OpenForWrite(std::string name, bool* direct, bool recycled);
  Task<Status> RemoveOwnFiles();
  Task<Status> WriteSegments(const File* file, const FileImage* image, bool direct, bool gather, bool recycled);
  Task<Status> Publish();

  LocalStorage* storage_;
  std::string name_;
  std::string tmp_name_;
  File tmp_dir_;
  bool replace_;
  // Several processes write this tmp dir (a multi-host save): files are
  // opened with O_TRUNC (a crashed earlier attempt may have left them), and
  // Abort removes only this writer's files.
  bool shared_;
  std::vector<std::string> created_;  // files this writer created
  bool finished_ = false;
};

class LocalReadable final : public ReadableFile {
 public:
  LocalReadable(Loop& loop, File file, uint64_t size) : loop_(loop), file_(std::move(file)), size_(size) {}
  uint64_t size() const override { return size_; }
  Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) override {
    CO_ASSIGN_OR_RETURN(size_t n, co_await loop_.Read(file_, dst, len, offset));
    if (n != len) {
      co_return CorruptionError(file_.path() + ": truncated: wanted " + std::to_string(len) +
                                " bytes at offset " + std::to_string(offset) + ", got " + std::to_string(n));
    }
    co_return Status::Ok();
  }

 private:
  Loop& loop_;
  File file_;
  uint64_t size_;
};

class LocalStorage final : public Storage {
 public:
  LocalStorage(Loop& loop, runtime::CpuPool& pool, std::string root, File root_dir, LocalOptions options)
      : loop_(loop), pool_(pool), root_(std::move(root)), root_dir_(std::move(root_dir)),
        options_(options), depth_(std::max(options.queue_depth, 1)) {}
  ~LocalStorage() override {
    if (bounce_ != nullptr) ::munmap(bounce_, BounceBytes());
  }

  const std::string& root() const override { return root_; }
  Task<Result<std::vector<Entry>>> List() override;
  Task<Result<std::unique_ptr<CheckpointWriter>>> StartCheckpoint(std::string name, bool replace,
                                                                 bool shared) override;
  Task<Result<std::string>> ReadSmallFile(std::string checkpoint, std::string file,
                                          uint64_t max_bytes) override;
  Task<Result<std::unique_ptr<ReadableFile>>> OpenFile(std::string checkpoint, std::string file) override;
  Task<Status> Remove(std::string name) override;
  Task<Status> Prune(std::string name) override;
  Status LockForWriting() override;

  Loop& loop() { return loop_; }
  int root_fd() const { return root_dir_.fd(); }
  const LocalOptions& options() const { return options_; }
  runtime::AsyncSemaphore& depth() { return depth_; }
  // Writes `image` to `*file` (opened O_DIRECT) as its DirectPlan says:
  // aligned runs straight from the segments, the rest through bounce
  // buffers. Adds the bytes it copied into bounce buffers to *bounced.
  Task<Status> WriteGathered(const File* file, const FileImage* image, uint64_t* bounced);
  std::string PathOf(const std::string& rel) const { return root_ + "/" + rel; }
  Task<Status> RemoveTree(std::string name);
  // Opens the root-relative file `rel` for reading, with its size: through
  // no symbolic link and not out of the root, without blocking on a FIFO,
  // and only if it is a regular file (Corruption naming what it is else).
  Task<Result<std::pair<File, uint64_t>>> OpenForReading(std::string rel);
  // Renames a file of the recycle bin to `name` in the tmp dir `dir`
  // (root-relative `tmp_name`), to be overwritten with `size` bytes: the
  // smallest that holds them, else the largest. False if there is none
  // (or another process took it): create the file instead.
  Task<bool> TakeRecycled(const File* dir, std::string tmp_name, std::string name, uint64_t size);
  Task<Status> FsyncRoot() { co_return co_await Sync(&root_dir_, /*datasync=*/false, ""); }
  FsObserver* observer() const { return observer_; }
  // fsync (or fdatasync) of `*file`, the root-relative `path`, told to the
  // test observer (if any) when it succeeds.
  // The errno the test observer wants `op` on `path` to fail with, or 0.
  int Injected(FsObserver::Op op, const std::string& path) const {
    return observer_ != nullptr ? observer_->Inject(op, path) : 0;
  }
  Task<Status> Sync(const File* file, bool datasync, std::string path) {
    if (int e = Injected(FsObserver::Op::kSync, path)) co_return ErrnoToStatus(e, datasync ? "fdatasync" : "fsync", file->path());
    Status s = co_await loop_.Fsync(*file, datasync);
    if (s.ok() && observer_ != nullptr) observer_->Synced(path);
    co_return s;
  }

 private:
  Loop& loop_;
  runtime::CpuPool& pool_;
  std::string root_;
  File root_dir_;
  LocalOptions options_;
  runtime::AsyncSemaphore depth_;
  UniqueFd lock_fd_;
  FsObserver* observer_ = g_observer.load();

  // Recycling needs the writer lock: only the one writer moves files in
  // and out of the bin. bin_ is touched on the loop thread only.
  // Not in a multi-host job: the committing process prunes every process's
  // shards but would reuse only its own, so the bin would never empty.
  bool recycling() const { return options_.recycle && lock_fd_.valid() && !multihost_; }
  bool multihost_ = false;  // a shared checkpoint was started
  // Renames checkpoint `name` to a tmp-del name, durably: it is gone for
  // readers. Returns that name.
  Task<Result<std::string>> Hide(std::string name);
  std::vector<BinFile> bin_;

  // Bounce buffers of WriteGathered: one of io.block_size bytes per write
  // in flight (io.queue_depth), mapped and touched at the first gathered
  // write and reused by every later one. Every gathered write holds a
  // depth_ permit while it holds a buffer, so one is always free.
  struct GatherState;
  Task<Status> MapBounce();
  Task<void> GatherLane(GatherState* g);
  size_t BounceCount() const { return static_cast<size_t>(std::max(options_.queue_depth, 1)); }
  size_t BounceBytes() const { return BounceCount() * options_.block_size; }
  char* bounce_ = nullptr;
  std::vector<char*> free_bounce_;
  bool bounce_mapping_ = false;
  runtime::AsyncEvent bounce_mapped_;
};

struct LocalStorage::GatherState {
  DirectPlan plan;
  const File* file;
  const FileImage* image;
  uint64_t bounced = 0;
  Status first_error;
};

Task<Status> LocalStorage::MapBounce() {
  if (bounce_mapping_) {
    co_await bounce_mapped_.Wait();
  } else {
    bounce_mapping_ = true;
    const size_t bytes = BounceBytes();
    // mmap, not the heap: aligned, and the pages are touched here on a pool
    // thread rather than by the first copies into them.
    auto map = [bytes]() -> char* {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
      (void)::madvise(p, bytes, MADV_HUGEPAGE);
      std::memset(p, 0, bytes);
      return static_cast<char*>(p);
    };
    char* p = co_await pool_.Run(map);
    if (p != nullptr) {
      bounce_ = p;
      for (size_t i = 0; i < BounceCount(); ++i) free_bounce_.push_back(p + i * options_.block_size);
    }
    bounce_mapped_.Set();
  }
  if (bounce_ == nullptr) {
    co_return ResourceExhaustedError("cannot map " + std::to_string(BounceBytes()) +
                                     " bytes of bounce buffers (io.queue_depth x io.block_size) for O_DIRECT "
                                     "writes of tensors that are not 4 KiB-aligned, under " + root_);
  }
  co_return Status::Ok();
}

Task<void> LocalStorage::GatherLane(GatherState* g) {
  while (!g->plan.done() && g->first_error.ok()) {
    const DirectWrite w = g->plan.Next();
    co_await depth_.Acquire();
    const char* src = w.data;
    char* buf = nullptr;
    if (src == nullptr) {
      buf = free_bounce_.back();
      free_bounce_.pop_back();
      const DirectPlan* plan = &g->plan;
      auto copy = [plan, w, buf] { plan->Gather(w, buf); };
      co_await pool_.Run(copy);
      src = buf;
      g->bounced += w.len;
    }
    Status st = co_await loop_.Write(*g->file, src, w.len, w.offset);
    if (buf != nullptr) free_bounce_.push_back(buf);
    depth_.Release();
    if (!st.ok()) {
      if (g->first_error.ok()) g->first_error = std::move(st);
    } else if (g->image->progress != nullptr) {
      const uint64_t data = std::min<uint64_t>(w.offset + w.len, g->image->size) - w.offset;
      g->image->progress->fetch_add(data, std::memory_order_relaxed);
    }
  }
}

Task<Status> LocalStorage::WriteGathered(const File* file, const FileImage* image, uint64_t* bounced) {
  CO_TRY(co_await MapBounce());
  GatherState g{DirectPlan(image, options_.block_size), file, image, 0, Status::Ok()};
  const uint64_t writes = (image->size + options_.block_size - 1) / options_.block_size;
  const size_t lanes = static_cast<size_t>(std::clamp<uint64_t>(writes, 1, std::max(options_.queue_depth, 1)));
  std::vector<Task<void>> tasks;
  tasks.reserve(lanes);
  for (size_t i = 0; i < lanes; ++i) tasks.push_back(GatherLane(&g));
  co_await WhenAll(std::move(tasks));
  *bounced += g.bounced;
  co_return std::move(g.first_error);
}

Task<Status> LocalStorage::RemoveTree(std::string name) {
  int fd = root_dir_.fd();
  auto work = [fd, name, root = root_, observer = observer_] { return RemoveTreeSync(fd, name, root, observer); };
  co_return co_await pool_.Run(work);
}

Task<Result<std::vector<Entry>>> LocalStorage::List() {
  auto work = [fd = root_dir_.fd(), root = root_]() -> Result<std::vector<Entry>> {
    int dup = ::openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dup < 0) return ErrnoToStatus(errno, "open", root);
    DIR* dir = ::fdopendir(dup);
    if (dir == nullptr) {
      ::close(dup);
      return ErrnoToStatus(errno, "list", root);
    }
    std::vector<Entry> out;
    while (dirent* e = ::readdir(dir)) {
      std::string name = e->d_name;
      if (name == "." || name == ".." || name[0] == '.') continue;
      if (e->d_type != DT_DIR && e->d_type != DT_UNKNOWN) continue;
      struct stat st;
      if (::fstatat(dup, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
      Entry entry{name, false, Status::Ok()};
      if (name.find(kTmpMarker) == std::string::npos) {
        entry.committed = ::faccessat(dup, (name + "/manifest.json").c_str(), F_OK, AT_SYMLINK_NOFOLLOW) == 0;
        if (!entry.committed && errno != ENOENT) {
          entry.problem = ErrnoToStatus(errno, "cannot look into", root + "/" + name);
        }
      }
      out.push_back(std::move(entry));
    }
    ::closedir(dir);
    return out;
  };
  co_return co_await pool_.Run(work);
}

Task<Result<std::unique_ptr<CheckpointWriter>>> LocalStorage::StartCheckpoint(std::string name, bool replace,
                                                                              bool shared) {
  // A shared checkpoint's tmp dir has a name every process can compute.
  std::string tmp = name + kTmpMarker + (shared ? std::string("shared") : Nonce());
  if (shared) multihost_ = true;
  Status made = co_await loop_.MkdirAt(root_dir_.fd(), tmp, 0755);
  if (!(shared && made.sys_errno() == EEXIST)) {
    CO_TRY(At(std::move(made), "mkdir", PathOf(tmp)));
    if (observer_ != nullptr) observer_->MadeDir(tmp);
  }
  auto dir = co_await loop_.OpenAt(root_dir_.fd(), tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  if (!dir.ok()) {
    Status cleanup = co_await RemoveTree(tmp);
    cleanup.IgnoreError();  // the open error is the one worth reporting
    co_return OpenFailed(dir.status(), PathOf(tmp));
  }
  File tmp_dir(UniqueFd(dir->release()), PathOf(tmp));
  co_return std::unique_ptr<CheckpointWriter>(
      new LocalWriter(this, std::move(name), std::move(tmp), std::move(tmp_dir), replace, shared));
}

Task<Result<std::pair<File, uint64_t>>> LocalStorage::OpenForReading(std::string rel) {
  const std::string path = PathOf(rel);
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer forever.
  Result<File> opened = co_await loop_.OpenBeneath(root_dir_.fd(), rel, O_RDONLY | O_NONBLOCK);
  if (!opened.ok()) co_return OpenFailed(opened.status(), path);
  File f(UniqueFd(opened->release()), path);
  CO_ASSIGN_OR_RETURN(struct statx st, co_await loop_.Statx(f.fd(), "", AT_EMPTY_PATH));
  if (!S_ISREG(st.stx_mode)) {
    co_return CorruptionError(path + ": " + FileKind(st.stx_mode) + " where a checkpoint file should be");
  }
  // Back to blocking reads: io_uring answers EAGAIN for an O_NONBLOCK file
  // whose data is not cached, rather than reading it.
  if (::fcntl(f.fd(), F_SETFL, 0) != 0) co_return ErrnoToStatus(errno, "fcntl", path);
  co_return std::pair<File, uint64_t>(std::move(f), st.stx_size);
}

Task<Result<std::string>> LocalStorage::ReadSmallFile(std::string checkpoint, std::string file,
                                                      uint64_t max_bytes) {
  CO_ASSIGN_OR_RETURN(auto opened, co_await OpenForReading(checkpoint + "/" + file));
  File& named = opened.first;
  const uint64_t size = opened.second;
  if (size > max_bytes) {
    co_return CorruptionError(named.path() + ": " + std::to_string(size) + " bytes, more than the " +
                              std::to_string(max_bytes) + " allowed");
  }
  std::string out(size, '\0');
  CO_ASSIGN_OR_RETURN(size_t n, co_await loop_.Read(named, out.data(), out.size(), 0));
  out.resize(n);
  CO_TRY(co_await loop_.Close(named));
  co_return out;
}

Task<Result<std::unique_ptr<ReadableFile>>> LocalStorage::OpenFile(std::string checkpoint, std::string file) {
  CO_ASSIGN_OR_RETURN(auto opened, co_await OpenForReading(checkpoint + "/" + file));
  co_return std::unique_ptr<ReadableFile>(new LocalReadable(loop_, std::move(opened.first), opened.second));
}

Task<Result<std::string>> LocalStorage::Hide(std::string name) {
  // Make the checkpoint disappear atomically before deleting anything.
  std::string doomed = name + kTmpMarker + "del-" + Nonce();
  if (int e = Injected(FsObserver::Op::kRename, name)) co_return ErrnoToStatus(e, "rename", PathOf(name));
  Status renamed = co_await loop_.RenameAt(root_dir_.fd(), name, root_dir_.fd(), doomed);
  CO_TRY(At(std::move(renamed), "rename", PathOf(name) + " to " + PathOf(doomed)));
  if (observer_ != nullptr) observer_->Renamed(name, doomed, /*exchange=*/false);
  CO_TRY(co_await FsyncRoot());
  co_return doomed;
}

Task<Status> LocalStorage::Remove(std::string name) {
  std::string doomed = name;
  if (name.find(kTmpMarker) == std::string::npos) {
    CO_ASSIGN_OR_RETURN(doomed, co_await Hide(name));
  }
  co_return co_await RemoveTree(doomed);
}

Task<Status> LocalStorage::Prune(std::string name) {
  // The bin holds one pruned checkpoint's files at most: while the saves
  // after it have not taken them all, prune by deleting.
  if (!recycling() || !bin_.empty()) {
    co_return co_await Remove(std::move(name));
  }
  CO_ASSIGN_OR_RETURN(std::string doomed, co_await Hide(name));
  auto work = [fd = root_dir_.fd(), doomed, root = root_, observer = observer_] {
    std::pair<Status, std::vector<BinFile>> out;
    out.first = RemoveTreeSync(fd, doomed, root, observer, &out.second);
    return out;
  };
  std::pair<Status, std::vector<BinFile>> done = co_await pool_.Run(work);
  for (BinFile& f : done.second) bin_.push_back(std::move(f));
  co_return std::move(done.first);
}

Task<bool> LocalStorage::TakeRecycled(const File* dir, std::string tmp_name, std::string name, uint64_t size) {
  if (!recycling() || bin_.empty()) co_return false;
  size_t pick = 0;
  for (size_t i = 1; i < bin_.size(); ++i) {
    const bool fits = bin_[i].size >= size, best_fits = bin_[pick].size >= size;
    if ((fits && (!best_fits || bin_[i].size < bin_[pick].size)) || (!fits && !best_fits && bin_[i].size > bin_[pick].size)) {
      pick = i;
    }
  }
  const std::string picked = bin_[pick].name;
  const std::string from = std::string(kRecycleDir) + "/" + picked;
  bin_.erase(bin_.begin() + static_cast<ptrdiff_t>(pick));
  // From the bin itself, never through a link named like it.
  UniqueFd bin(::openat(root_dir_.fd(), kRecycleDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW));
  if (!bin.valid()) co_return false;
  Status moved = co_await loop_.RenameAt(bin.get(), picked, dir->fd(), name, RENAME_NOREPLACE);
  if (!moved.ok()) co_return false;
  if (observer_ != nullptr) observer_->Renamed(from, tmp_name + "/" + name, /*exchange=*/false);
  co_return true;
}

Status LocalStorage::LockForWriting() {
  if (lock_fd_.valid()) return Status::Ok();
  const std::string path = PathOf(".ckptio.lock");
  UniqueFd fd(::openat(root_dir_.fd(), ".ckptio.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644));
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
      return FailedPreconditionError("another process is writing checkpoints to " + root_ +
                                     " (it holds the lock " + path + ")");
    }
    return ErrnoToStatus(errno, "lock", path);
  }
  lock_fd_ = std::move(fd);
  if (options_.recycle) {
    // Files an earlier writer left in the bin (a small directory: one
    // checkpoint's shards at most).
    bin_.clear();
    int bin_fd = ::openat(root_dir_.fd(), kRecycleDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (bin_fd >= 0) {
      if (DIR* dir = ::fdopendir(bin_fd)) {
        while (dirent* e = ::readdir(dir)) {
          struct stat st;
          if (e->d_name[0] == '.' || ::fstatat(bin_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
              !S_ISREG(st.st_mode)) {
            continue;
          }
          bin_.push_back({e->d_name, static_cast<uint64_t>(st.st_size)});
        }
        ::closedir(dir);
      } else {
        ::close(bin_fd);
      }
    }
  }
  return Status::Ok();
}

LocalWriter::~LocalWriter() = default;

Task<Result<File>> LocalWriter::OpenForWrite(std::string name, bool* direct, bool recycled) {
  Loop& loop = storage_->loop();
  // A recycled file is already in place; it is overwritten, then cut to size.
  const int base = O_WRONLY | O_NOFOLLOW | (recycled ? 0 : O_CREAT | (shared_ ? O_TRUNC : O_EXCL));
  if (*direct) {
    auto f = co_await loop.OpenAt(tmp_dir_.fd(), name, base | O_DIRECT);
    if (f.ok() || f.status().sys_errno() != EINVAL ||
        storage_->options().direct == Options::Io::Direct::kOn) {
      co_return std::move(f);
    }
    // The file system refuses O_DIRECT (the failed open may already have
    // created the file, hence O_TRUNC rather than O_EXCL): write buffered.
    *direct = false;
    co_return co_await loop.OpenAt(tmp_dir_.fd(), name, O_WRONLY | O_NOFOLLOW | (recycled ? 0 : O_CREAT | O_TRUNC));
  }
  co_return co_await loop.OpenAt(tmp_dir_.fd(), name, base);
}

Task<Status> LocalWriter::WriteSegments(const File* file, const FileImage* image, bool direct, bool gather,
                                        bool recycled) {
  const LocalOptions& o = storage_->options();
  uint64_t written_end = 0;
  if (int e = storage_->Injected(FsObserver::Op::kWrite, tmp_name_ + "/" + image->name)) {
    co_return ErrnoToStatus(e, "write", file->path());
  }
  if (direct && image->size > 0) {
    // Allocate the whole file first: an O_DIRECT write past the end of file
    // must update the size, which ext4 and XFS do synchronously (io_uring
    // then punts every write to a worker thread); writes inside the file
    // stay asynchronous. It also reserves the space up front, so a full
    // disk fails here, before any data moves.
    CO_TRY(co_await storage_->loop().Fallocate(*file, 0, 0, RoundUp(image->size, kDirectAlign)));
  }
  uint64_t bounced = 0;
  if (gather) {
    CO_TRY(co_await storage_->WriteGathered(file, image, &bounced));
    written_end = RoundUp(image->size, kDirectAlign);
  } else {
    for (const Segment& s : image->segments) {
      size_t len = direct ? RoundUp(s.len, kDirectAlign) : s.len;
      CO_TRY(co_await runtime::WriteInBlocks(storage_->loop(), file, s.data, len, s.offset, o.block_size,
                                             o.queue_depth, &storage_->depth(), image->progress));
      written_end = std::max<uint64_t>(written_end, s.offset + len);
    }
  }
  if (storage_->observer() != nullptr) storage_->observer()->Wrote(tmp_name_ + "/" + image->name, direct, bounced);
  // An O_DIRECT write of the last block went out padded, or a recycled file
  // was longer: cut the file back. ftruncate is a quick metadata update (it
  // frees at most the tail), so it runs inline.
  if ((written_end > image->size || recycled) && ::ftruncate(file->fd(), static_cast<off_t>(image->size)) != 0) {
    co_return ErrnoToStatus(errno, "truncate", file->path());
  }
  co_return Status::Ok();
}

Task<Status> LocalWriter::WriteFile(const FileImage* image) {
  // Segments that are not all block-aligned in memory (borrowed tensors)
  // still go out with O_DIRECT, partly through bounce buffers: the page
  // cache would cost a copy too, plus its own overhead and writeback.
  bool direct = storage_->options().direct != Options::Io::Direct::kOff;
  bool aligned = true;
  for (const Segment& s : image->segments) aligned = aligned && DirectEligible(s);
  // A pruned checkpoint's file if there is one: no allocation, no unlink.
  bool recycled = false;
  if (!shared_) recycled = co_await storage_->TakeRecycled(&tmp_dir_, tmp_name_, image->name, image->size);
  const std::string rel = tmp_name_ + "/" + image->name;
  if (recycled) created_.push_back(image->name);
  Result<File> opened = co_await OpenForWrite(image->name, &direct, recycled);
  if (recycled && opened.ok() && !OnlyOpener(opened->fd())) {
    // Someone else still holds the pruned file: leave it its bytes (our
    // name goes; the inode lives on while they hold it) and write a new one.
    File taken = std::move(opened).value();
    CO_TRY(co_await storage_->loop().Close(taken));
    CO_TRY(co_await storage_->loop().UnlinkAt(tmp_dir_.fd(), image->name));
    if (storage_->observer() != nullptr) storage_->observer()->Removed(rel);
    created_.pop_back();
    recycled = false;
    opened = co_await OpenForWrite(image->name, &direct, recycled);
  }
  if (!opened.ok()) co_return OpenFailed(opened.status(), tmp_dir_.path() + "/" + image->name);
  File f = std::move(opened).value();
  const bool gather = direct && !aligned;
  if (!recycled) {
    created_.push_back(image->name);
    if (storage_->observer() != nullptr) storage_->observer()->CreatedFile(rel);
  }
  File file(UniqueFd(f.release()), tmp_dir_.path() + "/" + image->name);
  Status s = co_await WriteSegments(&file, image, direct, gather, recycled);
  // fdatasync: the data and the size needed to read it back; the rename
  // protocol does not depend on timestamps.
  if (s.ok()) s = co_await storage_->Sync(&file, /*datasync=*/true, rel);
  Status c = co_await storage_->loop().Close(file);
  co_return s.ok() ? c : s;
}

Task<Status> LocalWriter::Commit(std::string manifest_json) {
  Loop& loop = storage_->loop();
  Result<File> opened = co_await loop.OpenAt(tmp_dir_.fd(), "manifest.json", O_WRONLY | O_CREAT | O_EXCL);
  if (!opened.ok()) co_return OpenFailed(opened.status(), tmp_dir_.path() + "/manifest.json");
  File m = std::move(opened).value();
  if (storage_->observer() != nullptr) storage_->observer()->CreatedFile(tmp_name_ + "/manifest.json");
  File manifest(UniqueFd(m.release()), tmp_dir_.path() + "/manifest.json");
  Status s = co_await loop.Write(manifest, manifest_json.data(), manifest_json.size(), 0);
  if (s.ok()) s = co_await storage_->Sync(&manifest, /*datasync=*/false, tmp_name_ + "/manifest.json");
  Status c = co_await loop.Close(manifest);
  CO_TRY(s);
  CO_TRY(c);
  // The directory's entries must be durable before the rename publishes
  // them, or a crash could leave a visible checkpoint with missing files.
  CO_TRY(co_await storage_->Sync(&tmp_dir_, /*datasync=*/false, tmp_name_));
  CO_TRY(co_await Publish());
  finished_ = true;
  co_return co_await loop.Close(tmp_dir_);
}

Task<Status> LocalWriter::Publish() {
  Loop& loop = storage_->loop();
  const int root = storage_->root_fd();
  if (int e = storage_->Injected(FsObserver::Op::kRename, tmp_name_)) {
    co_return ErrnoToStatus(e, "rename", storage_->PathOf(tmp_name_) + " to " + storage_->PathOf(name_));
  }
  Status renamed = co_await loop.RenameAt(root, tmp_name_, root, name_, RENAME_NOREPLACE);
  FsObserver* observer = storage_->observer();
  if (renamed.ok() && observer != nullptr) observer->Renamed(tmp_name_, name_, /*exchange=*/false);
  if (renamed.sys_errno() == EEXIST && replace_) {
    // Swap the new checkpoint in atomically; the old one ends up under the
    // tmp name and is removed below (or as debris after a crash).
    CO_TRY(co_await loop.RenameAt(root, tmp_name_, root, name_, RENAME_EXCHANGE));
    if (observer != nullptr) observer->Renamed(tmp_name_, name_, /*exchange=*/true);
    CO_TRY(co_await storage_->FsyncRoot());
    co_return co_await storage_->RemoveTree(tmp_name_);
  }
  if (renamed.sys_errno() == EEXIST) {
    co_return AlreadyExistsError(storage_->PathOf(name_) + " already exists");
  }
  CO_TRY(At(std::move(renamed), "rename", storage_->PathOf(tmp_name_) + " to " + storage_->PathOf(name_)));
  co_return co_await storage_->FsyncRoot();
}

Task<Status> LocalWriter::WriteSmall(std::string name, std::string bytes) {
  // Written aside and renamed into place, so that another process polling
  // for it sees nothing or all of it.
  Loop& loop = storage_->loop();
  const std::string partial = name + ".partial";
  Result<File> opened = co_await loop.OpenAt(tmp_dir_.fd(), partial, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW);
  if (!opened.ok()) co_return OpenFailed(opened.status(), tmp_dir_.path() + "/" + partial);
  File f = std::move(opened).value();
  FsObserver* observer = storage_->observer();
  if (observer != nullptr) observer->CreatedFile(tmp_name_ + "/" + partial);
  File file(UniqueFd(f.release()), tmp_dir_.path() + "/" + partial);
  Status s = co_await loop.Write(file, bytes.data(), bytes.size(), 0);
  if (s.ok()) s = co_await storage_->Sync(&file, /*datasync=*/false, tmp_name_ + "/" + partial);
  Status c = co_await loop.Close(file);
  CO_TRY(s);
  CO_TRY(c);
  CO_TRY(co_await loop.RenameAt(tmp_dir_.fd(), partial, tmp_dir_.fd(), name));
  if (observer != nullptr) observer->Renamed(tmp_name_ + "/" + partial, tmp_name_ + "/" + name, /*exchange=*/false);
  created_.push_back(name);
  co_return Status::Ok();
}

Task<Result<std::string>> LocalWriter::ReadSmall(std::string name, uint64_t max_bytes) {
  co_return co_await storage_->ReadSmallFile(tmp_name_, std::move(name), max_bytes);
}

Task<Status> LocalWriter::RemoveOwnFiles() {
  Status first;
  for (const std::string& name : created_) {
    Status s = co_await storage_->loop().UnlinkAt(tmp_dir_.fd(), name);
    if (s.ok() && storage_->observer() != nullptr) storage_->observer()->Removed(tmp_name_ + "/" + name);
    if (!s.ok() && s.code() != StatusCode::kNotFound && first.ok()) first = std::move(s);
  }
  co_return first;
}

Task<Status> LocalWriter::Abort() {
  if (finished_) co_return Status::Ok();
  finished_ = true;
  if (shared_) {
    // Other processes may still be writing here: take back only our files;
    // the directory is debris for recovery once a newer step commits.
    Status s = co_await RemoveOwnFiles();
    // (No co_await inside ?: — g++ 12 mishandles the temporaries there.)
    Status c;
    if (tmp_dir_.valid()) c = co_await storage_->loop().Close(tmp_dir_);
    co_return s.ok() ? c : s;
  }
  if (tmp_dir_.valid()) CO_TRY(co_await storage_->loop().Close(tmp_dir_));
  co_return co_await storage_->RemoveTree(tmp_name_);
}

}  // namespace

void SetFsObserverForTesting(FsObserver* observer) { g_observer = observer; }

Task<Result<std::unique_ptr<Storage>>> OpenLocalStorage(Loop& loop, runtime::CpuPool& pool, std::string root,
                                                        LocalOptions options, bool create) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (create) {
    auto mkdirs = [root]() -> Status {
      std::error_code ec;
      std::filesystem::create_directories(root, ec);
      if (ec) return ErrnoToStatus(ec.value(), "create directory", root);
      return Status::Ok();
    };
    CO_TRY(co_await pool.Run(mkdirs));
  }
  auto opened = co_await loop.OpenAt(AT_FDCWD, root, O_RDONLY | O_DIRECTORY);
  if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
    co_return NotFoundError("checkpoint root " + root + " does not exist");
  }
  CO_ASSIGN_OR_RETURN(File dir, std::move(opened));
  co_return std::unique_ptr<Storage>(new LocalStorage(loop, pool, root, std::move(dir), options));
}

}  // namespace ckptio::storage
