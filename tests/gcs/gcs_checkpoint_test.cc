// CheckpointManager on gs:// against the GCS emulator behind the fault proxy;
// run under tests/gcs/with_gcs.py (STORAGE_EMULATOR_HOST points at the proxy).

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "gcs_test_util.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

using Json = nlohmann::json;
using testing::Env;
using testing::ProxyControl;

std::string UniqueRoot(const std::string& stem) {
  static int n = 0;
  return stem + "-" + std::to_string(++n) + "-" + std::to_string(std::random_device{}() % 100000);
}

Options GcsOptions() {
  Options o = testing::SmallOptions(64 << 20);
  o.gcs.chunk_size = 256 << 10;
  o.gcs.retry.max_attempts = 4;
  o.gcs.retry.initial_backoff = std::chrono::milliseconds(5);
  o.gcs.retry.max_backoff = std::chrono::milliseconds(50);
  o.gcs.timeouts.stall = std::chrono::milliseconds(2000);
  return o;
}

// Direct access to the bucket (through the proxy) to look at objects.
struct Bucket {
  Bucket() {
    loop = std::move(runtime::Loop::Create()).value();
    http = std::move(http::HttpClient::Create(*loop, {})).value();
    auth = std::move(gcs::MakeAuth(*loop, *http, {}, /*emulator=*/true)).value();
    client = std::make_unique<gcs::GcsClient>(*loop, *http, *auth, Env("STORAGE_EMULATOR_HOST"), Options::Gcs{});
    control = std::make_unique<ProxyControl>(*loop, *http);
    control->Reset();
  }
  ~Bucket() { control->Reset(); }
  std::vector<std::string> Names(const std::string& prefix) {
    auto listed = loop->Run(client->List(name, prefix, ""));
    REQUIRE_MESSAGE(listed.ok(), listed.status().ToString());
    std::vector<std::string> out;
    for (const auto& o : listed->objects) out.push_back(o.name);
    return out;
  }
  void Put(const std::string& object, const std::string& body) {
    REQUIRE(loop->Run(client->UploadSmall(name, object, body, {})).ok());
  }

  std::string name = Env("CKPTIO_TEST_BUCKET");
  std::unique_ptr<runtime::Loop> loop;
  std::unique_ptr<http::HttpClient> http;
  std::unique_ptr<gcs::AuthProvider> auth;
  std::unique_ptr<gcs::GcsClient> client;
  std::unique_ptr<ProxyControl> control;
};

std::unique_ptr<CheckpointManager> OpenOrDie(const std::string& root, const Options& o) {
  auto m = CheckpointManager::Open(root, o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  return std::move(m).value();
}

bool SameState(const RestoredCheckpoint& r, const std::vector<testing::OwnedTensor>& want) {
  if (r.tensors.size() != want.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (r.tensors[i].name != want[i].name || r.tensors[i].bytes != want[i].bytes) return false;
  }
  return true;
}

TEST_CASE("a checkpoint saved to gs:// restores bit-exact, verifies, and lists as shards plus manifest") {
  Bucket b;
  const std::string prefix = UniqueRoot("ckpt");
  const std::string root = "gs://" + b.name + "/" + prefix;
  auto m = OpenOrDie(root, GcsOptions());
  auto state = testing::MakeState(7, 5, 300'000);  // 6 MB in 1 MiB shards
  auto refs = testing::Refs(state);
  auto h = m->Save(7, refs, R"({"where": "gcs"})");
  REQUIRE(h.ok());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  auto r = m->Restore(7);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(SameState(*r, state));
  CHECK(Json::parse(r->metadata_json) == Json{{"where", "gcs"}});
  auto v = m->Verify(7);
  REQUIRE_MESSAGE(v.ok(), v.status().ToString());
  CHECK(v->shards >= 5);
  std::vector<std::string> names = b.Names(prefix + "/");
  CHECK(names.size() == v->shards + 1);
  CHECK(std::count(names.begin(), names.end(), prefix + "/checkpoint_7/manifest.json") == 1);
  CHECK(m->root() == root);
}

TEST_CASE("slices of rows (column strips) restore from gs:// bit-exact, and the rest of a tensor is checked") {
  Bucket b;
  const std::string root = "gs://" + b.name + "/" + UniqueRoot("strips");
  auto m = OpenOrDie(root, GcsOptions());
  auto state = testing::MakeState(3, 2, 300'000);  // 1.2 MB tensors, seen as 300 x 4000-byte matrices
  REQUIRE(m->Save(3, testing::Refs(state))->Wait().ok());
  const Bytes& want = state[1].bytes;
  const uint64_t cols = 4000, rows = want.size() / cols;
  REQUIRE(rows * cols == want.size());
  Bytes left(rows * 1000), mid(rows * 24);  // columns [0, 1000) and [2000, 2024): the rest read for the CRC
  auto read = m->RestoreSlices(3, std::vector<TensorSlice>{{state[1].name, 0, 1000, left.data(), rows, cols, 1000},
                                                           {state[1].name, 2000, 24, mid.data(), rows, cols, 24}});
  REQUIRE_MESSAGE(read.ok(), read.status().ToString());
  for (uint64_t r = 0; r < rows; ++r) {
    CHECK(std::equal(left.begin() + static_cast<ptrdiff_t>(r * 1000), left.begin() + static_cast<ptrdiff_t>(r * 1000 + 1000),
                     want.begin() + static_cast<ptrdiff_t>(r * cols)));
    CHECK(std::equal(mid.begin() + static_cast<ptrdiff_t>(r * 24), mid.begin() + static_cast<ptrdiff_t>(r * 24 + 24),
                     want.begin() + static_cast<ptrdiff_t>(r * cols + 2000)));
  }
}

TEST_CASE("prune on gs:// deletes the manifest before the shards and keeps the right steps") {
  Bucket b;
  const std::string prefix = UniqueRoot("prune");
  Options o = GcsOptions();
  o.keep = 2;
  auto m = OpenOrDie("gs://" + b.name + "/" + prefix, o);
  for (int64_t step = 1; step <= 3; ++step) {
    auto state = testing::MakeState(step, 3, 200'000);
    auto refs = testing::Refs(state);
    auto h = m->Save(step, refs);
    REQUIRE(h.ok());
  }
  REQUIRE(m->WaitUntilFinished().ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{2, 3});
  for (const std::string& n : b.Names(prefix + "/")) CHECK(n.find("checkpoint_1/") == std::string::npos);
  // In the proxy's log, step 1's manifest went before any of its shards.
  int manifest_at = -1, first_shard_at = -1, i = 0;
  for (const auto& e : b.control->Log()) {
    if (e.value("method", "") == "DELETE" && e.value("path", "").find("checkpoint_1%2F") != std::string::npos) {
      if (e.value("path", "").find("manifest.json") != std::string::npos) {
        manifest_at = i;
      } else if (first_shard_at < 0) {
        first_shard_at = i;
      }
    }
    ++i;
  }
  CHECK(manifest_at >= 0);
  CHECK(first_shard_at > manifest_at);
}

TEST_CASE("recovery deletes unfinished steps older than the newest commit and leaves newer ones") {
  Bucket b;
  const std::string prefix = UniqueRoot("recover");
  const std::string root = "gs://" + b.name + "/" + prefix;
  b.Put(prefix + "/checkpoint_1/shard-00000.safetensors", "crashed before its manifest");
  b.Put(prefix + "/checkpoint_9/shard-00000.safetensors", "maybe still in flight elsewhere");
  {
    auto m = OpenOrDie(root, GcsOptions());
    auto state = testing::MakeState(5, 2, 1000);
    auto refs = testing::Refs(state);
    REQUIRE(m->Save(5, refs)->Wait().ok());
    CHECK(m->AllSteps() == std::vector<int64_t>{5});
  }
  auto m = OpenOrDie(root, GcsOptions());  // recovery runs here
  std::vector<std::string> names = b.Names(prefix + "/");
  CHECK(std::none_of(names.begin(), names.end(),
                     [](const std::string& n) { return n.find("checkpoint_1/") != std::string::npos; }));
  CHECK(std::count(names.begin(), names.end(), prefix + "/checkpoint_9/shard-00000.safetensors") == 1);
  CHECK(m->AllSteps() == std::vector<int64_t>{5});
}

TEST_CASE("a 503 on a middle chunk and on the manifest still ends in a verified checkpoint") {
  Bucket b;
  b.control->SetRules(Json::array(
      {{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 3}, {"status", 503}},
       {{"method", "POST"}, {"path", "manifest\\.json"}, {"nth", 1}, {"status", 503}}}));
  const std::string root = "gs://" + b.name + "/" + UniqueRoot("flaky");
  auto m = OpenOrDie(root, GcsOptions());
  auto state = testing::MakeState(3, 4, 300'000);
  auto refs = testing::Refs(state);
  auto h = m->Save(3, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  auto v = m->Verify(3);
  CHECK_MESSAGE(v.ok(), v.status().ToString());
  auto r = m->Restore(3);
  REQUIRE(r.ok());
  CHECK(SameState(*r, state));
}

TEST_CASE("a shard that never uploads fails the save clearly and commits nothing") {
  Bucket b;
  const std::string prefix = UniqueRoot("doomed");
  const std::string root = "gs://" + b.name + "/" + prefix;
  auto m = OpenOrDie(root, GcsOptions());
  auto first = testing::MakeState(1, 2, 1000);
  auto first_refs = testing::Refs(first);
  REQUIRE(m->Save(1, first_refs)->Wait().ok());
  b.control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"status", 503}, {"message", "down"}}}));
  auto state = testing::MakeState(2, 3, 300'000);
  auto refs = testing::Refs(state);
  auto h = m->Save(2, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(s.message().find("cannot save step 2 to " + root) == 0);
  CHECK(s.message().find("HTTP 503: down") != std::string::npos);
  CHECK(m->WaitUntilFinished().code() == StatusCode::kUnavailable);  // reported again, once
  b.control->Reset();
  CHECK(m->AllSteps() == std::vector<int64_t>{1});
  for (const std::string& n : b.Names(prefix + "/checkpoint_2/")) CHECK_MESSAGE(false, "left behind: " << n);
  auto r = m->Restore();
  REQUIRE(r.ok());
  CHECK(r->step == 1);
  CHECK(SameState(*r, first));
}

TEST_CASE("a manifest that already exists on gs:// fails the save with AlreadyExists") {
  Bucket b;
  const std::string prefix = UniqueRoot("raced");
  auto m = OpenOrDie("gs://" + b.name + "/" + prefix, GcsOptions());
  b.Put(prefix + "/checkpoint_4/manifest.json", "{}");  // another writer got there first
  auto state = testing::MakeState(4, 1, 1000);
  auto refs = testing::Refs(state);
  auto h = m->Save(4, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  CHECK(s.code() == StatusCode::kAlreadyExists);
  CHECK(s.message().find("checkpoint_4/manifest.json already exists") != std::string::npos);
}

TEST_CASE("a corrupted read on gs:// fails restore with the shard and tensor named") {
  Bucket b;
  const std::string prefix = UniqueRoot("corrupt");
  auto m = OpenOrDie("gs://" + b.name + "/" + prefix, GcsOptions());
  auto state = testing::MakeState(6, 2, 100'000);
  auto refs = testing::Refs(state);
  REQUIRE(m->Save(6, refs)->Wait().ok());
  b.control->SetRules(Json::array(
      {{{"method", "GET"}, {"path", "shard-00000.*alt=media"}, {"headers", {{"Range", "bytes=4096-"}}},
        {"corrupt_response_byte", 10}}}));
  auto r = m->Restore(6);
  CHECK(r.status().code() == StatusCode::kCorruption);
  CHECK(r.status().message().find("shard-00000.safetensors: tensor \"layer0/w\"") != std::string::npos);
}

// Threads of this process whose name starts with `stem`.
int ThreadsNamed(const std::string& stem) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name.rfind(stem, 0) == 0) ++n;
  }
  return n;
}

TEST_CASE("with gcs.loops 4 uploads run on 3 more loop threads, survive a 503, restore bit-exact, and count every byte") {
  Bucket b;
  b.control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 5}, {"status", 503}}}));
  Options o = GcsOptions();
  o.gcs.loops = 4;
  o.gcs.connections = 4;  // one per loop
  const std::string prefix = UniqueRoot("loops");
  auto m = OpenOrDie("gs://" + b.name + "/" + prefix, o);
  CHECK(ThreadsNamed("ckptio-gcs-") == 3);
  auto state = testing::MakeState(11, 8, 500'000);  // 8 shards of ~4 MB
  auto refs = testing::Refs(state);
  auto h = m->Save(11, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(b.control->Fired() == 1);
  // Progress adds up over the shards (each upload adds its own bytes).
  auto listed = b.loop->Run(b.client->List(b.name, prefix + "/checkpoint_11/", ""));
  REQUIRE(listed.ok());
  uint64_t shard_bytes = 0;
  int shards = 0;
  for (const auto& obj : listed->objects) {
    if (obj.name.find("manifest.json") != std::string::npos) continue;
    shard_bytes += obj.size;
    ++shards;
  }
  CHECK(shards >= 8);
  CHECK(h->bytes_written() == shard_bytes);
  // Reads spread over the loops too.
  auto r = m->Restore(11);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(SameState(*r, state));
  auto v = m->Verify(11);
  CHECK_MESSAGE(v.ok(), v.status().ToString());
  m.reset();
  CHECK(ThreadsNamed("ckptio-gcs-") == 0);
}

TEST_CASE("a 1 GiB shard uploads in chunks and restores bit-exact") {
  Bucket b;
  Options o = GcsOptions();
  o.staging_memory = (1u << 30) + (16 << 20);
  o.shard_size = 1u << 30;
  o.gcs.chunk_size = 64 << 20;  // 16 chunks; the emulator keeps uploads in memory
  o.gcs.timeouts.stall = std::chrono::seconds(60);  // the emulator copies the growing object per chunk
  const std::string prefix = UniqueRoot("big");
  auto m = OpenOrDie("gs://" + b.name + "/" + prefix, o);
  std::vector<testing::OwnedTensor> big{testing::MakeTensor("big", DType::kU8, {uint64_t{1} << 30}, 1)};
  auto refs = testing::Refs(big);
  auto h = m->Save(1, refs);
  REQUIRE(h.ok());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(b.control->Count("PUT", "upload_id=") == 17);  // 16 full chunks and a 4 KiB tail (the header)
  std::vector<MutableTensorRef> into{{"big", DType::kU8, {uint64_t{1} << 30}, nullptr}};
  Bytes back(uint64_t{1} << 30);
  into[0].data = back.data();
  auto step = m->RestoreInto(1, into);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  CHECK(back == big[0].bytes);
}

}  // namespace
}  // namespace ckptio
