// EIO and ENOSPC on a shard write, an fsync and a rename, injected through
// LocalStorage's test hook (a disk that fails on cue cannot be had for real
// here; the full-disk case also runs for real on a small tmpfs in
// disk_full_test.cc): the save fails with an error naming the step, the path
// and the errno text; nothing committed is lost; the next save succeeds.

#include <doctest/doctest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <regex>
#include <string>

#include "ckptio/checkpoint_manager.h"
#include "storage/local_storage.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;
using Op = storage::FsObserver::Op;

// Fails the first `op` whose path matches `pattern`, once armed.
class FailingDisk final : public storage::FsObserver {
 public:
  FailingDisk(Op op, const std::string& pattern, int err) : op_(op), pattern_(pattern), err_(err) {}
  void Arm() { armed_ = true; }
  bool fired() const { return fired_; }
  int Inject(Op op, const std::string& path) override {
    std::lock_guard lock(mu_);
    if (!armed_ || fired_ || op != op_ || !std::regex_search(path, pattern_)) return 0;
    fired_ = true;
    return err_;
  }

 private:
  std::mutex mu_;
  Op op_;
  std::regex pattern_;
  int err_;
  std::atomic<bool> armed_{false};
  bool fired_ = false;
};

struct Case {
  const char* what;
  Op op;
  const char* pattern;  // of the root-relative path
  const char* syscall;
};

void RunCase(const Case& c, int err) {
  CAPTURE(c.what);
  CAPTURE(err);
  testing::TempDir dir;
  FailingDisk disk(c.op, c.pattern, err);
  storage::SetFsObserverForTesting(&disk);
  Options o;
  o.staging_memory = 16 << 20;
  o.shard_size = 1 << 20;
  o.keep = 0;
  auto m = CheckpointManager::Open(dir.path(), o);
  REQUIRE(m.ok());
  auto first = testing::MakeState(1, 3, 200'000);
  auto first_refs = testing::Refs(first);
  REQUIRE((*m)->Save(1, first_refs)->Wait().ok());

  disk.Arm();
  auto state = testing::MakeState(2, 3, 200'000);
  auto refs = testing::Refs(state);
  auto h = (*m)->Save(2, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  CHECK(disk.fired());
  CHECK(s.code() == (err == ENOSPC ? StatusCode::kNoSpace : StatusCode::kIoError));
  CHECK(s.message().find("cannot save step 2 to " + dir.path() + ": " + c.syscall + " " + dir.path()) == 0);
  CHECK(s.message().find(std::strerror(err)) != std::string::npos);
  MESSAGE(s.message());
  CHECK((*m)->WaitUntilFinished().code() == s.code());  // raised again, once

  CHECK((*m)->AllSteps() == std::vector<int64_t>{1});
  for (const auto& e : fs::directory_iterator(dir.path())) {
    CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos, "debris " << e.path());
  }
  auto v = (*m)->Verify(1);
  CHECK_MESSAGE(v.ok(), v.status().ToString());

  auto next = (*m)->Save(3, refs);  // the disk works again
  REQUIRE(next.ok());
  CHECK(next->Wait().ok());
  CHECK((*m)->AllSteps() == std::vector<int64_t>{1, 3});
  m->reset();
  storage::SetFsObserverForTesting(nullptr);
}

TEST_CASE("EIO and ENOSPC on a shard write, a shard fsync, the manifest fsync, the tmp-dir fsync and the rename") {
  const Case cases[] = {
      {"shard write", Op::kWrite, "shard-00001", "write"},
      {"shard fdatasync", Op::kSync, "shard-00000", "fdatasync"},
      {"manifest fsync", Op::kSync, "manifest.json", "fsync"},
      {"tmp-dir fsync", Op::kSync, "^checkpoint_2\\.tmp-[0-9a-f]+$", "fsync"},
      {"rename into place", Op::kRename, "checkpoint_2.tmp-", "rename"},
  };
  for (const Case& c : cases) {
    RunCase(c, EIO);
    RunCase(c, ENOSPC);
  }
}

TEST_CASE("a rename that fails while pruning is reported and loses nothing") {
  testing::TempDir dir;
  FailingDisk disk(Op::kRename, "checkpoint_1", EIO);
  storage::SetFsObserverForTesting(&disk);
  Options o;
  o.staging_memory = 16 << 20;
  o.keep = 1;
  auto m = CheckpointManager::Open(dir.path(), o);
  REQUIRE(m.ok());
  auto state = testing::MakeState(1, 1, 1000);
  auto refs = testing::Refs(state);
  REQUIRE((*m)->Save(1, refs)->Wait().ok());
  disk.Arm();
  REQUIRE((*m)->Save(2, refs)->Wait().ok());  // committed; pruning step 1 then fails
  Status s = (*m)->WaitUntilFinished();
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(s.message().find("cannot prune step 1 in " + dir.path()) == 0);
  CHECK(fs::exists(dir / "checkpoint_1/manifest.json"));
  CHECK(fs::exists(dir / "checkpoint_2/manifest.json"));
  m->reset();
  storage::SetFsObserverForTesting(nullptr);
}

}  // namespace
}  // namespace ckptio
