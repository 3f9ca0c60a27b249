// Disk full: on a 64 MiB tmpfs mounted by the test, a save that does not fit
// fails with "No space left on device", nothing committed is lost, and a save
// succeeds again once space returns. Needs root (mount); CI runs as root.

#include <doctest/doctest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;

class SmallTmpfs {
 public:
  SmallTmpfs() {
    ok_ = ::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "size=64m") == 0;
    error_ = ok_ ? "" : std::strerror(errno);
  }
  ~SmallTmpfs() {
    if (ok_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string path() const { return dir_.path(); }

 private:
  testing::TempDir dir_;
  bool ok_ = false;
  std::string error_;
};

TEST_CASE("a save on a full disk fails with No space left on device and loses nothing committed") {
  SmallTmpfs fs_;
  REQUIRE_MESSAGE(fs_.ok(), "cannot mount a tmpfs (the test needs root): " << fs_.error());
  const std::string root = fs_.path() + "/ckpt";
  Options o;
  o.staging_memory = 48 << 20;
  o.shard_size = 4 << 20;
  o.keep = 0;
  auto m = CheckpointManager::Open(root, o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  auto& mgr = **m;

  for (int64_t step = 1; step <= 3; ++step) {  // 3 x 12 MB
    auto state = testing::MakeState(step, 6, 500'000);
    auto refs = testing::Refs(state);
    auto h = mgr.Save(step, refs);
    REQUIRE(h.ok());
    REQUIRE_MESSAGE(h->Wait().ok(), h->Wait().ToString());
  }
  auto big = testing::MakeState(4, 10, 1'000'000);  // 40 MB: more than is left
  auto big_refs = testing::Refs(big);
  auto h = mgr.Save(4, big_refs);
  REQUIRE(h.ok());
  Status failed = h->Wait();
  CHECK(failed.code() == StatusCode::kNoSpace);
  CHECK(failed.message().find("cannot save step 4 to " + root) == 0);
  CHECK(failed.message().find("No space left on device") != std::string::npos);
  MESSAGE("the error: " << failed.message());

  // The failure is raised again by the next call, once.
  Status again = mgr.WaitUntilFinished();
  CHECK(again.code() == StatusCode::kNoSpace);
  CHECK(again.message().find("cannot save step 4") != std::string::npos);
  CHECK(mgr.WaitUntilFinished().ok());

  // Nothing committed was lost, nothing half-written is left.
  CHECK(mgr.AllSteps() == std::vector<int64_t>{1, 2, 3});
  for (const auto& e : fs::directory_iterator(root)) {
    CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos, e.path());
  }
  for (int64_t step = 1; step <= 3; ++step) {
    auto v = mgr.Verify(step);
    CHECK_MESSAGE(v.ok(), v.status().ToString());
  }

  // Space returns: the next save succeeds.
  REQUIRE(mgr.Delete(1).ok());
  REQUIRE(mgr.Delete(2).ok());
  auto retry = mgr.Save(4, big_refs);
  REQUIRE(retry.ok());
  CHECK(retry->Wait().ok());
  auto r = mgr.Restore(4);
  REQUIRE(r.ok());
  CHECK(r->tensors[9].bytes == big[9].bytes);
}

TEST_CASE("the error of a failed background save is raised by the next Save") {
  SmallTmpfs fs_;
  REQUIRE_MESSAGE(fs_.ok(), "cannot mount a tmpfs (the test needs root): " << fs_.error());
  Options o;
  o.staging_memory = 80 << 20;
  o.keep = 0;
  auto m = CheckpointManager::Open(fs_.path() + "/ckpt", o);
  REQUIRE(m.ok());
  auto big = testing::MakeState(1, 18, 1'000'000);  // 72 MB: cannot fit
  auto refs = testing::Refs(big);
  auto h = (*m)->Save(1, refs);
  REQUIRE_MESSAGE(h.ok(), h.status().ToString());
  CHECK(h->Wait().code() == StatusCode::kNoSpace);
  auto small = testing::MakeState(2, 1, 1000);
  auto small_refs = testing::Refs(small);
  auto next = (*m)->Save(2, small_refs);
  CHECK(next.status().code() == StatusCode::kNoSpace);
  CHECK(next.status().message().find("an earlier background save failed: cannot save step 1") == 0);
  auto after = (*m)->Save(2, small_refs);  // reported once; the next save runs
  REQUIRE(after.ok());
  CHECK(after->Wait().ok());
}

}  // namespace
}  // namespace ckptio
