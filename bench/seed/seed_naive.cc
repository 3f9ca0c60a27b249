// The naive mode of `ckptio bench seed` (see seed_naive.h): the saver that
// spawns a thread per save, the local-disk thread body, and its audit.

#include "seed/seed_naive.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "base/status_macros.h"
#include "cli/trainer_sim.h"
#include "format/crc32c.h"
#include "base/dtype.h"
#include "gcs/gcs_url.h"

namespace ckptio::cli {
namespace naive {
namespace {

uint64_t BytesOf(const TensorRef& t) { return base::TensorBytes(t.dtype, t.shape).value(); }

std::string Errno(int err) { return std::strerror(err); }

// Plain POSIX: create (truncate) and write, no fsync.
bool WriteFile(const std::string& path, const TensorRef& t, Shared* shared, ThreadRecord* record) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    shared->CountWriteError("open " + path + ": " + Errno(errno));
    return false;
  }
  const char* p = static_cast<const char*>(t.data);
  for (uint64_t left = BytesOf(t); left > 0;) {
    const ssize_t n = ::write(fd, p, std::min<uint64_t>(left, uint64_t{64} << 20));
    if (n <= 0) {
      shared->CountWriteError("write " + path + ": " + Errno(n < 0 ? errno : EIO));
      ::close(fd);
      return false;
    }
    p += n;
    left -= static_cast<uint64_t>(n);
    record->bytes_written += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return true;
}

// The entries of `dir`; nullopt and errno set if it cannot be read.
std::optional<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return std::nullopt;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  ::closedir(d);
  return names;
}

// rm -r of one checkpoint, the way a naive pruner does it. Whatever is
// already gone (another pruner got there first) is reported as such.
Shared::PruneOutcome RemoveLocalCheckpoint(const std::string& dir, std::string* what) {
  auto files = ListDir(dir);
  if (!files) {
    *what = "list " + dir + ": " + Errno(errno);
    return errno == ENOENT ? Shared::PruneOutcome::kAlreadyGone : Shared::PruneOutcome::kOther;
  }
  bool gone = false;
  for (const std::string& f : *files) {
    if (::unlink((dir + "/" + f).c_str()) != 0) {
      if (errno != ENOENT) {
        *what = "unlink " + dir + "/" + f + ": " + Errno(errno);
        return Shared::PruneOutcome::kOther;
      }
      gone = true;
      *what = "unlink " + dir + "/" + f + ": " + Errno(ENOENT);
    }
  }
  if (::rmdir(dir.c_str()) != 0) {
    // ENOTEMPTY: a writer created files after the listing.
    *what = "rmdir " + dir + ": " + Errno(errno);
    return errno == ENOENT ? Shared::PruneOutcome::kAlreadyGone : Shared::PruneOutcome::kOther;
  }
  return gone ? Shared::PruneOutcome::kAlreadyGone : Shared::PruneOutcome::kOk;
}

// Newest first: the steps a keep-K pruner deletes, from a listing.
std::vector<int64_t> Doomed(std::vector<int64_t> steps, int keep) {
  std::sort(steps.rbegin(), steps.rend());
  if (keep <= 0 || steps.size() <= static_cast<size_t>(keep)) return {};
  return {steps.begin() + keep, steps.end()};
}

void PruneLocal(Shared* shared, ThreadRecord* record) {
  const std::string& root = shared->target().root;
  auto names = ListDir(root);
  if (!names) {
    shared->CountPrune(Shared::PruneOutcome::kOther, false, "list " + root + ": " + Errno(errno));
    return;
  }
  std::vector<int64_t> steps;
  for (const std::string& n : *names) {
    if (int64_t s = ParseStepDirName(n); s >= 0) steps.push_back(s);
  }
  for (int64_t step : Doomed(std::move(steps), shared->config().keep)) {
    const bool in_flight = shared->Writing(step);
    std::string what;
    const Shared::PruneOutcome o = RemoveLocalCheckpoint(root + "/" + StepDirName(step), &what);
    shared->CountPrune(o, in_flight, what);
    if (o == Shared::PruneOutcome::kOk) ++record->pruned;
  }
}

// CRC32C of a whole file, or nullopt if it cannot be read.
std::optional<uint32_t> FileCrc(const std::string& path, uint64_t size) {
  if (size == 0) return format::Crc32c(nullptr, 0);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return std::nullopt;
  const uint32_t crc = format::Crc32c(p, size);
  ::munmap(p, size);
  return crc;
}

StepAudit AuditLocalStep(const SeedConfig& config, const std::string& root, int64_t step,
                         std::span<const TensorRef> tensors, const ExpectedCrcs& expected) {
  StepAudit a;
  a.step = step;
  a.expected = ExpectedKept(config, step);
  const std::string dir = root + "/" + StepDirName(step);
  struct stat st;
  a.present = ::stat(dir.c_str(), &st) == 0;
  if (!a.present) return a;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string path = dir + "/" + TensorFileName(i);
    if (::stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) == BytesOf(tensors[i])) ++a.tensors_present;
  }
  a.complete = a.tensors_present == static_cast<int>(tensors.size());
  auto it = expected.find(step);
  if (!a.complete || it == expected.end()) return a;
  a.checked = true;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto crc = FileCrc(dir + "/" + TensorFileName(i), BytesOf(tensors[i]));
    if (!crc || *crc != it->second[i]) ++a.tensors_torn;
  }
  return a;
}

Status CleanupLocal(const std::string& root) {
  auto names = ListDir(root);
  if (!names) return errno == ENOENT ? Status::Ok() : ErrnoToStatus(errno, "cannot list", root);
  for (const std::string& n : *names) {
    if (ParseStepDirName(n) < 0) continue;  // only what the naive mode writes
    std::string what;
    if (RemoveLocalCheckpoint(root + "/" + n, &what) == Shared::PruneOutcome::kOther) {
      return IoError("cannot remove an earlier naive checkpoint: " + what);
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Target> MakeTarget(const SeedConfig& config) {
  Target t;
  t.root = config.ModeRoot(SeedMode::kNaive);
  t.gcs = config.gcs();
  if (!t.gcs) return t;
  ASSIGN_OR_RETURN(gcs::GcsPath path, gcs::ParseGcsUrl(t.root));
  t.bucket = path.bucket;
  t.prefix = path.prefix;
  t.options = config.options.gcs;
  // As storage::OpenGcsStorage chooses it.
  t.endpoint = t.options.endpoint;
  if (t.endpoint.empty()) {
    const char* host = std::getenv("STORAGE_EMULATOR_HOST");
    if (host != nullptr && *host != '\0') {
      t.endpoint = host;
      if (t.endpoint.find("://") == std::string::npos) t.endpoint = "http://" + t.endpoint;
      t.emulator = true;
    } else {
      t.endpoint = "https://storage.googleapis.com";
    }
  }
  return t;
}

std::string StepDirName(int64_t step) { return "checkpoint_" + std::to_string(step); }

std::string TensorFileName(size_t i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "tensor-%03zu.bin", i);
  return buf;
}

int64_t ParseStepDirName(const std::string& name) {
  static const std::string kPrefix = "checkpoint_";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  std::string digits = name.substr(kPrefix.size());
  if (!digits.empty() && digits.back() == '/') digits.pop_back();
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
  }
  return std::stoll(digits);
}

void Shared::BeginWriting(int64_t step) {
  std::lock_guard lock(mu_);
  writing_.insert(step);
  errors_.max_concurrent = std::max(errors_.max_concurrent, static_cast<int>(writing_.size()));
}

void Shared::EndWriting(int64_t step) {
  std::lock_guard lock(mu_);
  writing_.erase(step);
}

bool Shared::Writing(int64_t step) const {
  std::lock_guard lock(mu_);
  return writing_.count(step) != 0;
}

void Shared::NoteError(const std::string& what) {
  if (errors_.first_error.empty()) errors_.first_error = what;
}

void Shared::CountPrune(PruneOutcome outcome, bool in_flight, const std::string& what) {
  std::lock_guard lock(mu_);
  if (in_flight) {
    ++errors_.prune_in_flight;
    NoteError("pruned a checkpoint still being written (" + what + ")");
  }
  if (outcome == PruneOutcome::kAlreadyGone) ++errors_.prune_already_gone;
  if (outcome == PruneOutcome::kOther) ++errors_.prune_other;
  if (outcome != PruneOutcome::kOk) NoteError(what);
}

void Shared::CountWriteError(const std::string& what) {
  std::lock_guard lock(mu_);
  ++errors_.write_errors;
  NoteError(what);
}

NaiveErrors Shared::errors() const {
  std::lock_guard lock(mu_);
  return errors_;
}

void RunLocalThread(Shared* shared, ThreadRecord* record) {
  const std::string dir = shared->target().root + "/" + StepDirName(record->step);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    shared->CountWriteError("mkdir " + dir + ": " + Errno(errno));
  } else {
    const std::vector<TensorRef>& tensors = shared->tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!WriteFile(dir + "/" + TensorFileName(i), tensors[i], shared, record)) ++record->write_errors;
    }
  }
  record->write_end = Clock::now();
  shared->EndWriting(record->step);
  PruneLocal(shared, record);
  record->end = Clock::now();
}

}  // namespace naive

namespace {

class NaiveSaver final : public SeedSaver {
 public:
  explicit NaiveSaver(std::unique_ptr<naive::Shared> shared) : shared_(std::move(shared)) {}
  ~NaiveSaver() override { Join(); }

  // The trainer's cost: starting a thread. It reads the live tensors.
  Status Save(int64_t step, std::span<const TensorRef>) override {
    naive::ThreadRecord* record = &records_.emplace_back();
    record->step = step;
    record->start = naive::Clock::now();
    shared_->BeginWriting(step);
    auto body = shared_->target().gcs ? naive::RunGcsThread : naive::RunLocalThread;
    threads_.emplace_back(body, shared_.get(), record);
    return Status::Ok();
  }

  Status Finish() override {
    Join();
    return Status::Ok();
  }

  void Collect(naive::Clock::time_point start, ModeResult* r) override {
    auto rel = [start](naive::Clock::time_point t) { return std::chrono::duration<double>(t - start).count(); };
    std::vector<std::pair<double, double>> writes;
    for (const naive::ThreadRecord& t : records_) {
      const std::string step = std::to_string(t.step);
      r->spans.push_back({"naive threads: write", "write " + step, rel(t.start), rel(t.write_end), ""});
      r->spans.push_back({"naive threads: prune", "prune (thread " + step + ")", rel(t.write_end), rel(t.end), ""});
      r->spans.push_back({"saves in flight", "step " + step, rel(t.start), rel(t.end), ""});
      writes.emplace_back(rel(t.start), rel(t.write_end));
      r->threads.push_back({t.step, rel(t.write_end) - rel(t.start), rel(t.end) - rel(t.write_end), t.write_errors,
                            t.pruned});
      r->bytes += t.bytes_written;
    }
    r->persisting = UnionLength(std::move(writes));
    r->naive = shared_->errors();
    r->max_in_flight = r->naive.max_concurrent;
  }

 private:
  void Join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  std::unique_ptr<naive::Shared> shared_;
  std::deque<naive::ThreadRecord> records_;  // stable addresses for the threads
  std::vector<std::thread> threads_;
};

}  // namespace

Result<std::unique_ptr<SeedSaver>> MakeNaiveSaver(const SeedConfig& config, std::span<const TensorRef> tensors) {
  ASSIGN_OR_RETURN(naive::Target target, naive::MakeTarget(config));
  RETURN_IF_ERROR(CleanupNaiveRoot(config));
  if (!target.gcs) {
    std::error_code ec;
    std::filesystem::create_directories(target.root, ec);
    if (ec) return ErrnoToStatus(ec.value(), "cannot create", target.root);
  }
  auto shared = std::make_unique<naive::Shared>(config, std::move(target), tensors);
  return std::unique_ptr<SeedSaver>(new NaiveSaver(std::move(shared)));
}

AuditResult AuditNaiveRoot(const SeedConfig& config, std::span<const TensorRef> tensors, const ExpectedCrcs& expected) {
  auto target = naive::MakeTarget(config);
  if (!target.ok()) {
    AuditResult audit;
    audit.error = target.status().message();
    return audit;
  }
  if (target->gcs) return naive::AuditGcs(config, *target, tensors, expected);
  AuditResult audit;
  audit.tensors = static_cast<int>(tensors.size());
  for (int i = 1; i <= config.saves; ++i) {
    audit.steps.push_back(naive::AuditLocalStep(config, target->root, SeedStep(i), tensors, expected));
  }
  return audit;
}

Status CleanupNaiveRoot(const SeedConfig& config) {
  ASSIGN_OR_RETURN(naive::Target target, naive::MakeTarget(config));
  if (target.gcs) return naive::CleanupGcs(target);
  RETURN_IF_ERROR(naive::CleanupLocal(target.root));
  ::rmdir(target.root.c_str());  // if nothing else is left in it
  return Status::Ok();
}

}  // namespace ckptio::cli
