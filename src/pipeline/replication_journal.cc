#include "pipeline/replication_journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "base/unique_fd.h"

namespace ckptio::pipeline {
namespace {

constexpr off_t kMaxJournalBytes = 1 << 20;

// The journal's text, or "" if there is none; an error says what is wrong.
Result<std::string> ReadJournal(const std::string& path) {
  base::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (!fd.valid()) {
    if (errno == ENOENT) return std::string();
    return ErrnoToStatus(errno, "open", path);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + ": not a regular file");
  if (st.st_size > kMaxJournalBytes) {
    return InvalidArgumentError(path + ": " + std::to_string(st.st_size) + " bytes, more than a journal has");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::read(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "read", path);
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  text.resize(done);
  return text;
}

Status FsyncDir(const std::string& dir) {
  base::UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, "open", dir);
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync", dir);
  return Status::Ok();
}

}  // namespace

ReplicationJournal ReplicationJournal::Load(std::string local_root, std::string remote, int64_t step) {
  ReplicationJournal j(std::move(local_root), std::move(remote), step);
  const std::string path = j.Path();
  Result<std::string> text = ReadJournal(path);
  Status problem = text.status();
  if (problem.ok() && text->empty()) return j;
  if (problem.ok()) {
    nlohmann::json doc = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    const bool valid = doc.is_object() && doc.contains("remote") && doc["remote"].is_string() &&
                       doc.contains("step") && doc["step"].is_number_integer() && doc.contains("sessions") &&
                       doc["sessions"].is_object();
    if (!valid) {
      problem = InvalidArgumentError(path + ": not a replication journal (an object with \"remote\", \"step\" "
                                     "and \"sessions\")");
    } else if (doc["remote"].get<std::string>() != j.remote_ || doc["step"].get<int64_t>() != step) {
      return j;  // an earlier copy, of another step or to another root: nothing to resume
    } else {
      for (const auto& [file, u] : doc["sessions"].items()) {
        const bool ok = u.is_object() && u.contains("uri") && u["uri"].is_string() && u.contains("bytes") &&
                        u["bytes"].is_number_unsigned() && u.contains("crc32c") && u["crc32c"].is_number_unsigned();
        if (ok) j.sessions_[file] = {u["uri"].get<std::string>(), u["bytes"].get<uint64_t>(), u["crc32c"].get<uint32_t>()};
      }
      return j;
    }
  }
  std::fprintf(stderr, "ckptio: warning: ignoring the replication journal: %s; the copy of step %lld to %s starts "
               "its uploads again\n", problem.message().c_str(), static_cast<long long>(step), j.remote_.c_str());
  return j;
}

ReplicationJournal::ReplicationJournal(ReplicationJournal&& o) noexcept
    : local_root_(std::move(o.local_root_)), remote_(std::move(o.remote_)), step_(o.step_),
      sessions_(std::move(o.sessions_)) {}

std::string ReplicationJournal::Session(const std::string& file, uint64_t bytes, uint32_t crc) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(file);
  if (it == sessions_.end() || it->second.bytes != bytes || it->second.crc != crc) return std::string();
  return it->second.session;
}

Status ReplicationJournal::Record(const std::string& file, uint64_t bytes, uint32_t crc, const std::string& session) {
  std::lock_guard lock(mu_);
  sessions_[file] = {session, bytes, crc};
  Status s = WriteLocked();
  if (!s.ok()) return s.WithContext("cannot record the upload session of " + file);
  return s;
}

Status ReplicationJournal::WriteLocked() {
  nlohmann::json sessions = nlohmann::json::object();
  for (const auto& [file, u] : sessions_) sessions[file] = {{"uri", u.session}, {"bytes", u.bytes}, {"crc32c", u.crc}};
  nlohmann::json doc = {{"remote", remote_}, {"step", step_}, {"sessions", std::move(sessions)}};
  const std::string text = doc.dump(1) + "\n";
  const std::string path = Path();
  const std::string tmp = path + ".tmp";
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, "remove", tmp);
  base::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) return ErrnoToStatus(errno, "create", tmp);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "write", tmp);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, "fsync", tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoToStatus(errno, "rename to " + path, tmp);
  return FsyncDir(local_root_);
}

Status ReplicationJournal::Clear() {
  std::lock_guard lock(mu_);
  sessions_.clear();
  if (::unlink(Path().c_str()) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return ErrnoToStatus(errno, "remove", Path());
  }
  return FsyncDir(local_root_);
}

}  // namespace ckptio::pipeline
