// LocalWriter: one checkpoint written into its tmp directory, then
// published by a rename (the protocol is in local_storage.h).

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "base/status_macros.h"
#include "runtime/block_writer.h"
#include "storage/local_internal.h"

namespace ckptio::storage::local {

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

}  // namespace ckptio::storage::local
