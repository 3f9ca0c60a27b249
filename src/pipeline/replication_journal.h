#pragma once
// The copy to the remote tier under way, kept durably in the local tier
// (ROOT/.ckptio-replication.json): the step, the remote root and the upload
// session of each file (with the file's size and CRC32C: a step saved again
// since, with other bytes, resumes nothing), recorded before the session's
// first byte is sent. A
// process killed mid-copy leaves it behind; the next one copying the same
// step to the same root asks those sessions what the server has and sends
// only the rest, instead of starting the uploads again. Session URIs let
// anyone holding them upload: the file is the owner's only (0600).
//
// Best effort on the way in: a journal that is missing, for another step or
// root, or unreadable (a warning names it) resumes nothing. On the way out,
// a session that cannot be recorded fails the upload (the copy is retried
// at the next open).
//
// Threads: Record may run on any thread (the uploads' loops); the others on
// one.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "ckptio/status.h"

namespace ckptio::pipeline {

class ReplicationJournal {
 public:
  static constexpr const char* kFileName = ".ckptio-replication.json";

  // The journal of `local_root` for copying `step` to `remote`.
  static ReplicationJournal Load(std::string local_root, std::string remote, int64_t step);

  ReplicationJournal(ReplicationJournal&& o) noexcept;

  // The session recorded for `file` of `bytes` bytes with CRC32C `crc`, or "".
  std::string Session(const std::string& file, uint64_t bytes, uint32_t crc) const;
  // Records `session` for `file`, durably (written aside, fsynced, renamed
  // over the journal, directory fsynced) before returning.
  Status Record(const std::string& file, uint64_t bytes, uint32_t crc, const std::string& session);
  // The copy ended (committed, or failed and undone): forgets it.
  Status Clear();

 private:
  ReplicationJournal(std::string local_root, std::string remote, int64_t step)
      : local_root_(std::move(local_root)), remote_(std::move(remote)), step_(step) {}
  std::string Path() const { return local_root_ + "/" + kFileName; }
  Status WriteLocked();

  std::string local_root_;
  std::string remote_;
  int64_t step_;
  mutable std::mutex mu_;
  struct Upload {
    std::string session;
    uint64_t bytes = 0;
    uint32_t crc = 0;
  };
  std::map<std::string, Upload> sessions_;  // guarded by mu_; by file
};

}  // namespace ckptio::pipeline
