#include "storage/local_storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "storage/local_internal.h"

namespace ckptio::storage {
namespace local {
namespace {

std::atomic<FsObserver*> g_observer{nullptr};

}  // namespace

LocalStorage::LocalStorage(Loop& loop, runtime::CpuPool& pool, std::string root, File root_dir, LocalOptions options)
    : loop_(loop), pool_(pool), root_(std::move(root)), root_dir_(std::move(root_dir)), options_(options),
      depth_(std::max(options.queue_depth, 1)), observer_(g_observer.load()) {}

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
    const DirectWrite w = g->plan.Next(/*direct=*/!waited_on());
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
  GatherState g{DirectPlan(image, options_.block_size, DirectMemoryAlign(file->fd())), file, image, 0, Status::Ok()};
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

Task<Status> LocalStorage::RemoveExcept(std::string name, std::vector<std::string> keep) {
  auto work = [fd = root_dir_.fd(), name, keep = std::move(keep), root = root_, observer = observer_] {
    return RemoveExceptSync(fd, name, keep, root, observer);
  };
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
  File direct;
  if (options_.direct != Options::Io::Direct::kOff && opened.second >= LocalReadable::kMinDirectRead) {
    // The same open file again, O_DIRECT (through its /proc link: no path
    // to race with). None where refused: every read goes through the cache.
    const std::string self = "/proc/self/fd/" + std::to_string(opened.first.fd());
    int fd = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) direct = File(UniqueFd(fd), opened.first.path());
  }
  co_return std::unique_ptr<ReadableFile>(
      new LocalReadable(loop_, std::move(opened.first), opened.second, std::move(direct)));
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
  ASSIGN_OR_RETURN(UniqueFd fd, LockRootSync(root_dir_.fd(), root_));
  lock_fd_ = std::move(fd);
  // Files an earlier writer left in the bin (one checkpoint's shards at most).
  if (options_.recycle) bin_ = ListBinSync(root_dir_.fd());
  return Status::Ok();
}
}  // namespace local

void SetFsObserverForTesting(FsObserver* observer) { local::g_observer = observer; }

Task<Result<std::unique_ptr<Storage>>> OpenLocalStorage(runtime::Loop& loop, runtime::CpuPool& pool, std::string root,
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
  CO_ASSIGN_OR_RETURN(runtime::File dir, std::move(opened));
  co_return std::unique_ptr<Storage>(new local::LocalStorage(loop, pool, root, std::move(dir), options));
}

}  // namespace ckptio::storage
