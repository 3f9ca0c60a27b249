#pragma once
// The parts of LocalStorage (local_storage.h) that its two files share: the
// LocalStorage and LocalWriter classes, and the plain synchronous file-system
// helpers of local_fs.cc (tree removal and the recycle bin, run on the CPU
// pool; the writer lock). Private to storage/.

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/align.h"
#include "base/status_macros.h"
#include "runtime/async_sync.h"
#include "runtime/cpu_pool.h"
#include "runtime/io_ops.h"
#include "runtime/loop.h"
#include "base/unique_fd.h"
#include "storage/direct_plan.h"
#include "storage/local_storage.h"

namespace ckptio::storage::local {

using runtime::File;
using runtime::Loop;
using base::UniqueFd;

constexpr size_t kDirectAlign = kDirectBlock;

using base::RoundUp;

// 16 hex digits, for tmp and bin names.
std::string Nonce();
// A segment can go out with O_DIRECT if its memory and file offset are
// block-aligned and its length, rounded up to a block, fits its capacity.
bool DirectEligible(const Segment& s);
// The memory alignment O_DIRECT writes to the open file `fd` need, as statx
// (STATX_DIOALIGN, Linux 6.1) reports it; the block where it says nothing.
size_t DirectMemoryAlign(int fd);
// "a FIFO", "a directory", ...: what sits where a regular file should be.
std::string FileKind(mode_t mode);
// An open of a path inside the root that failed, said plainly: the open
// follows no symbolic link and never leaves the root (OpenBeneath).
Status OpenFailed(const Status& s, const std::string& path);
// A failed operation renamed after the absolute `path` (io_uring ops name
// the root-relative path they were given), so messages say where.
Status At(Status s, std::string_view what, const std::string& path);

// ---- the recycle bin (see local_storage.h) ----

// Where Prune keeps the files it recycles (a hidden name: List skips it).
inline constexpr const char* kRecycleDir = ".recycle";

// A file in kRecycleDir.
struct BinFile {
  std::string name;
  uint64_t size = 0;
};

// Whether the recycled file open as `fd` is ours alone, so overwriting it
// harms nobody: no other name (hard link) and no other open file (a reader
// in another process that opened the pruned checkpoint before the prune,
// whose reads must go on seeing the old bytes). A write lease is granted
// only while no other open file refers to the inode; where leases are not
// supported (NFS), nothing is proven: false.
bool OnlyOpener(int fd);
// The regular files in the bin under the root `root_fd` (none if there is
// no bin, or if it is not a directory of its own).
std::vector<BinFile> ListBinSync(int root_fd);

// Deletes directory `name` under `dirfd` and the files in it (one level: a
// checkpoint has no subdirectories); with `recycled`, moves the shard files
// worth it into kRecycleDir instead and lists them there. Plain syscalls:
// runs on a pool thread.
Status RemoveTreeSync(int dirfd, const std::string& name, const std::string& root, FsObserver* observer,
                      std::vector<BinFile>* recycled = nullptr);
// Storage::RemoveExcept on directory `name` under `dirfd`: unlinks
// manifest.json and fsyncs the directory, then unlinks every other entry not
// in `keep`. Plain syscalls: runs on a pool thread.
Status RemoveExceptSync(int dirfd, const std::string& name, const std::vector<std::string>& keep,
                        const std::string& root, FsObserver* observer);

// Opens <root>/.ckptio.lock (never through a link, only a regular file) and
// takes its exclusive flock, or says who holds it.
Result<UniqueFd> LockRootSync(int root_fd, const std::string& root);

// ---- the classes ----

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

// A file opened for reading. One at least kMinDirectRead long also has a
// second descriptor opened O_DIRECT (`direct_`), and its reads of whole
// blocks go around the page cache: a restore reads each byte once, and the
// page cache would cost a copy per byte and memory the size of the state
// (on this VM's virtio disk a 4 GiB restore went from 0.42x to ~0.8x of
// fio's read). The bytes before the first block boundary and after the last
// are read through the page cache. Where the memory does not agree with the
// file offset in alignment, the caller bounces (ReadAtBounced). A file
// system that refuses O_DIRECT reads (EINVAL) is read through the page
// cache from then on.
class LocalReadable final : public ReadableFile {
 public:
  static constexpr uint64_t kMinDirectRead = uint64_t{64} << 10;

  LocalReadable(Loop& loop, File file, uint64_t size, File direct = {})
      : loop_(loop), file_(std::move(file)), size_(size), direct_(std::move(direct)) {
    direct_ok_ = direct_.valid();
    if (direct_ok_) mem_align_ = DirectMemoryAlign(direct_.fd());
  }
  uint64_t size() const override { return size_; }
  bool PrefersBounce() const override { return direct_ok_; }
  bool ReadsDirect(uint64_t offset, const char* dst, size_t len) const override {
    if (!direct_ok_ || len < kMinDirectRead) return false;
    // The first whole block lands on memory O_DIRECT accepts.
    const uint64_t skew = RoundUp(offset, kDirectAlign) - offset;
    return (reinterpret_cast<uintptr_t>(dst) + skew) % mem_align_ == 0;
  }
  Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) override {
    if (!ReadsDirect(offset, dst, len)) co_return co_await ReadBuffered(offset, dst, len);
    const uint64_t from = RoundUp(offset, kDirectAlign);
    const uint64_t to = (offset + len) / kDirectAlign * kDirectAlign;
    if (from >= to) co_return co_await ReadBuffered(offset, dst, len);
    if (from > offset) CO_TRY(co_await ReadBuffered(offset, dst, from - offset));
    char* mid = dst + (from - offset);
    Result<size_t> n = co_await loop_.Read(direct_, mid, to - from, from);
    if (!n.ok()) {
      // Refused (or failed) around the cache: the cache decides, for good.
      direct_ok_ = false;
      CO_TRY(co_await ReadBuffered(from, mid, to - from));
    } else {
      CO_TRY(Whole(from, to - from, *n));
    }
    if (offset + len > to) CO_TRY(co_await ReadBuffered(to, dst + (to - offset), offset + len - to));
    co_return Status::Ok();
  }
  Task<Status> ReadAtV(uint64_t offset, std::span<struct iovec> iov, char* /*scratch*/) override {
    size_t len = 0;
    bool aligned = direct_ok_ && offset % kDirectAlign == 0;
    for (const struct iovec& v : iov) {
      len += v.iov_len;
      aligned = aligned && v.iov_len % kDirectAlign == 0 && reinterpret_cast<uintptr_t>(v.iov_base) % mem_align_ == 0;
    }
    if (aligned && len >= kMinDirectRead) {
      std::vector<struct iovec> copy(iov.begin(), iov.end());  // a failed read may have advanced nothing, or some
      Result<size_t> n = co_await loop_.ReadV(direct_, copy.data(), copy.size(), offset);
      if (n.ok()) co_return Whole(offset, len, *n);
      direct_ok_ = false;
    }
    CO_ASSIGN_OR_RETURN(size_t n, co_await loop_.ReadV(file_, iov.data(), iov.size(), offset));
    co_return Whole(offset, len, n);
  }
  Task<Result<const char*>> ReadAtBounced(uint64_t offset, size_t len, char* bounce) override {
    if (direct_ok_ && len >= kMinDirectRead) {
      const uint64_t from = offset / kDirectAlign * kDirectAlign;
      const uint64_t to = RoundUp(offset + len, kDirectAlign);  // past the end of the file: a short read
      Result<size_t> n = co_await loop_.Read(direct_, bounce, to - from, from);
      if (n.ok()) {
        const uint64_t need = offset + len - from;
        if (*n < need) CO_TRY(Whole(from, need, *n));
        co_return static_cast<const char*>(bounce + (offset - from));
      }
      direct_ok_ = false;
    }
    CO_TRY(co_await ReadBuffered(offset, bounce, len));
    co_return static_cast<const char*>(bounce);
  }

 private:
  Task<Status> ReadBuffered(uint64_t offset, char* dst, size_t len) {
    CO_ASSIGN_OR_RETURN(size_t n, co_await loop_.Read(file_, dst, len, offset));
    co_return Whole(offset, len, n);
  }
  // Ok if a read of `len` bytes at `offset` got them all (n), else "truncated".
  Status Whole(uint64_t offset, size_t len, size_t n) const {
    if (n == len) return Status::Ok();
    return CorruptionError(file_.path() + ": truncated: wanted " + std::to_string(len) + " bytes at offset " +
                           std::to_string(offset) + ", got " + std::to_string(n));
  }

  Loop& loop_;
  File file_;
  uint64_t size_;
  // The same file opened O_DIRECT, or none; kept open once refused (reads
  // of other lanes may be queued on its descriptor), but no longer used.
  File direct_;
  bool direct_ok_ = false;
  size_t mem_align_ = kDirectAlign;
};

class LocalStorage final : public Storage {
 public:
  LocalStorage(Loop& loop, runtime::CpuPool& pool, std::string root, File root_dir, LocalOptions options);
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
  Task<Status> RemoveExcept(std::string name, std::vector<std::string> keep) override;
  Status LockForWriting() override;
  // 512: the memory alignment O_DIRECT needs on a block device of 512-byte
  // logical blocks (DirectMemoryAlign asks each file; one that needs more
  // gathers what does not agree, as any unaligned buffer).
  uint32_t AddressModulus() const override { return options_.direct != Options::Io::Direct::kOff ? 512 : 0; }
  // While waited on, memory that could go out straight is copied into the
  // bounce buffers too: their huge pages make a few large device requests
  // where 4 KiB pages of the caller's memory make many segments (on this
  // virtio disk 3.7 against 2.3 GiB/s); otherwise the copy's CPU is the
  // trainer's to use.
  void SetWaitedOn(bool waited_on) override { waiters_.fetch_add(waited_on ? 1 : -1, std::memory_order_relaxed); }
  bool waited_on() const { return waiters_.load(std::memory_order_relaxed) > 0; }

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
  FsObserver* observer_;
  std::atomic<int> waiters_{0};  // SetWaitedOn

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


}  // namespace ckptio::storage::local
