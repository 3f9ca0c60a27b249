// What a user types as a checkpoint root, and what ckptio makes of it.

#include "storage/open_storage.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "test_util.h"

namespace ckptio::storage {
namespace {

namespace fs = std::filesystem;

// Runs the test body in `dir` as the working directory, and back.
class InDirectory {
 public:
  explicit InDirectory(const std::string& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ~InDirectory() { fs::current_path(old_); }

 private:
  fs::path old_;
};

TEST_CASE("a URL with a scheme other than gs:// or file:// is refused, naming the accepted forms") {
  for (const char* text : {"gcs://b/run", "s3://bucket/x", "S3://bucket/x", "gs:/b/x", "gs:b", "gs://",
                           "http://host/x", "hdfs://nn/ckpt", "file:relative", "file://relative/x", "ckpt:v2"}) {
    CAPTURE(text);
    auto r = ParseRootUrl(text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find(std::string("\"") + text + "\"") != std::string::npos);
    CHECK(r.status().message().find("gs://BUCKET[/PREFIX]") != std::string::npos);
    CHECK(r.status().message().find("local path") != std::string::npos);
  }
}

TEST_CASE("an unknown scheme's error tells how to name a local directory that looks like it") {
  auto r = ParseRootUrl("gcs://b/run");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("write ./gcs://b/run") != std::string::npos);
}

TEST_CASE("gs:// roots need a bucket name GCS accepts and a prefix without . or .. segments") {
  for (const char* text : {"gs://B/x", "gs://ab", "gs://a b/x", "gs://bucket/../x", "gs://bucket/./x",
                           "gs://bucket//x"}) {
    CAPTURE(text);
    auto r = ParseRootUrl(text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find(text) != std::string::npos);
  }
  auto ok = ParseRootUrl("gs://my-bucket/runs/7/");
  REQUIRE(ok.ok());
  CHECK(ok->kind == RootUrl::Kind::kGcs);
  CHECK(ok->path == "gs://my-bucket/runs/7");
  auto bare = ParseRootUrl("gs://my-bucket");
  REQUIRE(bare.ok());
  CHECK(bare->path == "gs://my-bucket");
}

TEST_CASE("local roots become absolute paths without . segments or trailing slashes") {
  testing::TempDir dir;
  InDirectory in(dir.path());
  const std::string cwd = fs::current_path().string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ckpt", cwd + "/ckpt"},
      {"./ckpt/", cwd + "/ckpt"},
      {"./gcs:/b/run", cwd + "/gcs:/b/run"},  // the documented spelling of such a directory
      {"a//b/./c", cwd + "/a/b/c"},
      {"../x", cwd + "/../x"},  // ".." stays: through a symlink it is not the lexical parent
      {"/data/ckpt/", "/data/ckpt"},
      {"file:///data/ckpt", "/data/ckpt"},
      {"/", "/"},
      {"2024:run", cwd + "/2024:run"},  // a scheme starts with a letter
  };
  for (const auto& [text, want] : cases) {
    CAPTURE(text);
    auto r = ParseRootUrl(text);
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    CHECK(r->kind == RootUrl::Kind::kLocal);
    CHECK(r->path == want);
  }
  CHECK_FALSE(ParseRootUrl("").ok());
  CHECK_FALSE(ParseRootUrl(std::string("a\0b", 3)).ok());
}

TEST_CASE("a manager opened on a bad scheme fails and writes nothing, not even the directory") {
  testing::TempDir dir;
  InDirectory in(dir.path());
  Options o;
  o.staging_memory = 1 << 20;
  for (const char* root : {"gcs://b/run", "s3://b/run", "gs:/b/x", "gs://"}) {
    CAPTURE(root);
    auto m = CheckpointManager::Open(root, o);
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == StatusCode::kInvalidArgument);
    auto r = CheckpointManager::OpenReadOnly(root, o);
    CHECK_FALSE(r.ok());
  }
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("the manager's root is the absolute path, so its messages name it") {
  testing::TempDir dir;
  InDirectory in(dir.path());
  Options o;
  o.staging_memory = 1 << 20;
  auto m = CheckpointManager::Open("./rel/ckpt/", o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  CHECK((*m)->root() == fs::current_path().string() + "/rel/ckpt");
  auto missing = (*m)->Restore(7);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().message().find(fs::current_path().string() + "/rel/ckpt") != std::string::npos);
}

}  // namespace
}  // namespace ckptio::storage
