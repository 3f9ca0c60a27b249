#pragma once
// Storage: where checkpoints live, behind one asynchronous interface.
//
// A checkpoint is a named group of files ("checkpoint_200/shard-00000.
// safetensors", ".../manifest.json"). The interface is shaped by the commit
// protocol rather than by POSIX: a CheckpointWriter writes a checkpoint's
// files where readers cannot see them, then Commit() makes the whole
// checkpoint appear at once, with the manifest as the commit point (local
// disk: tmp dir + fsync + rename; GCS: shards first, manifest object last).
//
// Threads: every method is called, and every task awaited, on the Loop thread
// the storage was opened on. Buffers passed in stay owned by the caller and
// must stay valid until the returned task finishes.

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "ckptio/status.h"
#include "format/crc32c.h"
#include "runtime/task.h"

namespace ckptio::runtime {
class AsyncEvent;
}

namespace ckptio::storage {

// Bytes [data, data + len) go to file offset `offset`. The `capacity` - len
// bytes after them are padding the writer may also write (as an O_DIRECT
// write rounds up to a block) before truncating the file to its size.
struct Segment {
  uint64_t offset = 0;
  const char* data = nullptr;
  size_t len = 0;
  size_t capacity = 0;  // >= len
};

// The complete image of one file: segments in order, covering [0, size).
struct FileImage {
  std::string name;  // a plain file name inside the checkpoint
  uint64_t size = 0;
  std::vector<Segment> segments;
  // CRC32C of the whole file, valid once *crc_ready is set (a remote store
  // sends it with the last bytes so the server can check them).
  const uint32_t* crc32c = nullptr;
  runtime::AsyncEvent* crc_ready = nullptr;
  // If set, bytes written so far are added here (read from other threads).
  std::atomic<uint64_t>* progress = nullptr;
  // A remote store's upload that survives a restart: the session an earlier
  // process started for this file (empty: none), and where a new session is
  // recorded before its first byte is sent (may run on another thread). A
  // local store ignores both.
  std::string resume_session;
  std::function<Status(const std::string& session)> record_session;
};

// Writes one checkpoint. Created by Storage::StartCheckpoint.
class CheckpointWriter {
 public:
  virtual ~CheckpointWriter() = default;
  // Writes one file completely and durably. Files may be written concurrently.
  virtual Task<Status> WriteFile(const FileImage* image) = 0;
  // Writes a small file (a multi-host fragment) completely and durably.
  virtual Task<Status> WriteSmall(std::string name, std::string bytes) = 0;
  // Reads a small file of this unfinished checkpoint (NotFound if absent):
  // how process 0 of a multi-host save gathers the others' fragments.
  virtual Task<Result<std::string>> ReadSmall(std::string name, uint64_t max_bytes) = 0;
  // Writes the manifest and makes the checkpoint visible, atomically and
  // durably. REQUIRES: every WriteFile finished OK.
  virtual Task<Status> Commit(std::string manifest_json) = 0;
  // Removes whatever this writer wrote; the checkpoint never becomes visible.
  virtual Task<Status> Abort() = 0;
};

// A file opened for reading.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly len bytes at offset into dst, or fails (a file shorter
  // than offset + len is Corruption: "truncated").
  virtual Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) = 0;
  // Reads the bytes at offset into the buffers of `iov` in turn (scattered:
  // the rows of a slice going to several destinations), or fails as ReadAt.
  // May advance the iovecs. The default reads once into `scratch` (the
  // caller's, at least the iovecs' total length; buffers of `iov` may lie in
  // it, each no later than its bytes' place in the read) and copies out: a
  // remote store, where each read is a request.
  virtual Task<Status> ReadAtV(uint64_t offset, std::span<struct iovec> iov, char* scratch) {
    size_t len = 0;
    for (const struct iovec& v : iov) len += v.iov_len;
    CO_TRY(co_await ReadAt(offset, scratch, len));
    size_t pos = 0;
    for (const struct iovec& v : iov) {
      std::memmove(v.iov_base, scratch + pos, v.iov_len);  // moved down within scratch, or out of it
      pos += v.iov_len;
    }
    co_return Status::Ok();
  }
  // Where a file reads around the page cache (O_DIRECT), it reads whole
  // blocks into memory that agrees with the file offset in alignment; other
  // memory is better served by reading into a bounce buffer of the caller's
  // and copying out (the copy is cheaper than the page cache's). A bounce
  // buffer holds len + 2 * kBounceSlack bytes, aligned to kBounceSlack.
  static constexpr size_t kBounceSlack = 4096;
  // Whether reads into a bounce buffer beat reads into memory that does not
  // agree with the file in alignment (ReadsDirect false).
  virtual bool PrefersBounce() const { return false; }
  // Whether ReadAt(offset, dst, len) reads straight into dst around the
  // page cache.
  virtual bool ReadsDirect(uint64_t offset, const char* dst, size_t len) const {
    (void)offset, (void)dst, (void)len;
    return false;
  }
  // Whether ReadAtCrc takes the CRC32C as the bytes arrive (a remote store:
  // each received block while it is in cache), so that the caller need not
  // read dst again to checksum it.
  virtual bool ChecksumsWhileReading() const { return false; }
  // Reads as ReadAt and sets *crc to the CRC32C of the len bytes read. The
  // default checksums dst after the read, on the calling thread.
  virtual Task<Status> ReadAtCrc(uint64_t offset, char* dst, size_t len, uint32_t* crc) {
    CO_TRY(co_await ReadAt(offset, dst, len));
    *crc = format::Crc32c(dst, len);
    co_return Status::Ok();
  }
  // Reads the len bytes at offset into `bounce` (see kBounceSlack) and
  // returns where in it they start, or fails as ReadAt.
  virtual Task<Result<const char*>> ReadAtBounced(uint64_t offset, size_t len, char* bounce) {
    CO_TRY(co_await ReadAt(offset, bounce, len));
    co_return static_cast<const char*>(bounce);
  }
};

// The marker of in-flight or half-removed checkpoint names ("checkpoint_300.tmp-1f2e..."):
// never a committed checkpoint, debris once its writer is gone.
inline constexpr const char* kTmpMarker = ".tmp-";

// One checkpoint-like name under the root.
struct Entry {
  std::string name;        // "checkpoint_200", "checkpoint_300.tmp-1f2e..."
  bool committed = false;  // its manifest exists
  // Why it could not be told whether the manifest exists (a directory that
  // cannot be searched); ok otherwise. A reader reports it, never skips it.
  Status problem;
};

class Storage {
 public:
  virtual ~Storage() = default;
  // "/data/ckpt" or "gs://bucket/prefix", for messages.
  virtual const std::string& root() const = 0;
  // Names directly under the root (directories or object prefixes).
  virtual Task<Result<std::vector<Entry>>> List() = 0;
  // Starts writing checkpoint `name`. With `replace`, Commit() replaces a
  // committed checkpoint of that name atomically. With `shared`, several
  // processes write the same checkpoint at once (each its own files) and one
  // of them commits it: the in-flight location is the same for all of them.
  virtual Task<Result<std::unique_ptr<CheckpointWriter>>> StartCheckpoint(std::string name, bool replace,
                                                                         bool shared = false) = 0;
  // Reads a whole small file (the manifest); error if it exceeds max_bytes.
  virtual Task<Result<std::string>> ReadSmallFile(std::string checkpoint, std::string file,
                                                  uint64_t max_bytes) = 0;
  virtual Task<Result<std::unique_ptr<ReadableFile>>> OpenFile(std::string checkpoint,
                                                               std::string file) = 0;
  // Removes a checkpoint, committed or not. A committed one disappears
  // atomically first (its manifest goes before its shards), so a crash in
  // the middle leaves debris, never a checkpoint with missing shards.
  virtual Task<Status> Remove(std::string name) = 0;
  // Removes a committed checkpoint that retention dropped, as Remove does;
  // a backend may keep its space for the checkpoints that follow (local
  // disk: its files are reused, see local_storage.h).
  virtual Task<Status> Prune(std::string name) { co_return co_await Remove(std::move(name)); }
  // Retention of a checkpoint whose files later checkpoints still refer to
  // (incremental saves): removes its manifest first (durably: from then on
  // it is not committed), then every file but those named in `keep`, which
  // stay where they are. Called again with fewer names as references go.
  virtual Task<Status> RemoveExcept(std::string name, std::vector<std::string> keep) = 0;
  // Takes the exclusive writer lock of the root, if the backend has one.
  // Error if another process holds it.
  virtual Status LockForWriting() = 0;
  // Requests retried after transient failures so far (readable from any
  // thread; a backend without retries says 0).
  virtual uint64_t retries() const { return 0; }
  // Requests made so far (a backend that makes none says 0).
  virtual uint64_t requests() const { return 0; }
  // Bytes of uploads an earlier process had sent that were not sent again.
  virtual uint64_t bytes_resumed() const { return 0; }
  // A file image's segment goes out without a copy where its file offset
  // agrees with its memory address modulo this (O_DIRECT's memory alignment),
  // so a save that borrows the caller's buffers lays them out to agree. 0: a
  // backend that sends any bytes from where they are.
  virtual uint32_t AddressModulus() const { return 0; }
  // The trainer is waiting for the writes under way (WaitUntilFinished, a
  // save that returns once written): spend CPU to finish sooner. Calls nest
  // (true adds a waiter, false removes one); callable from any thread.
  virtual void SetWaitedOn(bool waited_on) { (void)waited_on; }
};

}  // namespace ckptio::storage
