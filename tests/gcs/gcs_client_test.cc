// GcsClient against a real GCS emulator (gcp-storage-emulator from PyPI)
// behind our fault-injecting proxy; run under tests/gcs/with_gcs.py.

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "runtime/when_all.h"
#include "format/crc32c.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "gcs_test_util.h"
#include "runtime/io_ops.h"

namespace ckptio::gcs {
namespace {

using testing::Env;
using testing::ProxyControl;
using Json = nlohmann::json;

constexpr uint64_t kQ = 256 * 1024;

std::string Bytes(size_t n, unsigned seed) {
  std::string s(n, '\0');
  std::mt19937_64 rng(seed);
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string UniqueName(const std::string& stem) {
  static int n = 0;
  return "client-test/" + stem + "-" + std::to_string(++n) + "-" + std::to_string(std::random_device{}());
}

// A loop, an HTTP client, credentials and a GcsClient with small chunks and
// quick retries, talking to the emulator through the proxy.
struct Fixture {
  Fixture() {
    loop = std::move(runtime::Loop::Create()).value();
    http::HttpOptions ho;
    ho.stall_timeout = std::chrono::milliseconds(1000);
    http = std::move(http::HttpClient::Create(*loop, ho)).value();
    control = std::make_unique<ProxyControl>(*loop, *http);
    control->Reset();
    options.chunk_size = kQ;
    options.retry.max_attempts = 5;
    options.retry.initial_backoff = std::chrono::milliseconds(5);
    options.retry.max_backoff = std::chrono::milliseconds(50);
    options.allow_http_credentials = true;  // the proxy is plain http on 127.0.0.1
    UseAuth(std::move(MakeAuth(*loop, *http, options, /*emulator=*/true)).value());
  }
  ~Fixture() { if (!std::getenv("CKPTIO_KEEP_PROXY_LOG")) control->Reset(); }
  void UseAuth(std::unique_ptr<AuthProvider> a) {
    auth = std::move(a);
    client = std::make_unique<GcsClient>(*loop, *http, *auth, Env("STORAGE_EMULATOR_HOST"), options);
  }
  template <typename T>
  T Run(Task<T> t) {
    return loop->Run(std::move(t));
  }
  Result<ObjectMeta> Upload(const std::string& name, const std::string& data, const uint32_t* crc = nullptr) {
    UploadSource src;
    src.pieces = {{data.data(), data.size()}};
    src.size = data.size();
    src.crc32c = crc;
    return Run(client->Upload(bucket, name, &src));
  }
  std::string ReadBack(const std::string& name, size_t size) {
    std::string out(size, '\0');
    Status s = Run(client->Read(bucket, name, 0, size, out.data(), size));
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    return out;
  }

  std::string bucket = Env("CKPTIO_TEST_BUCKET");
  Options::Gcs options;
  std::unique_ptr<runtime::Loop> loop;
  std::unique_ptr<http::HttpClient> http;
  std::unique_ptr<ProxyControl> control;
  std::unique_ptr<AuthProvider> auth;
  std::unique_ptr<GcsClient> client;
};

TEST_CASE_FIXTURE(Fixture, "a multi-chunk resumable upload reads back equal, whole and by range") {
  const std::string name = UniqueName("multi");
  const std::string data = Bytes(5 * kQ + 12345, 1);
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  auto meta = Upload(name, data, &crc);
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(meta->size == data.size());
  CHECK(meta->crc32c == crc);
  CHECK(control->Count("PUT", "upload_id=") == 6);  // 5 full chunks and the tail
  CHECK(ReadBack(name, data.size()) == data);
  std::string part(1000, '\0');
  REQUIRE(Run(client->Read(bucket, name, 3 * kQ - 500, part.size(), part.data(), data.size())).ok());
  CHECK(part == data.substr(3 * kQ - 500, 1000));
}

TEST_CASE_FIXTURE(Fixture, "an empty object and a one-chunk object upload too") {
  const std::string empty = UniqueName("empty");
  auto m0 = Upload(empty, "");
  REQUIRE_MESSAGE(m0.ok(), m0.status().ToString());
  CHECK(m0->size == 0);
  const std::string small = UniqueName("small");
  auto m1 = Upload(small, "hello");
  REQUIRE(m1.ok());
  CHECK(ReadBack(small, 5) == "hello");
}

TEST_CASE_FIXTURE(Fixture, "an object that fits a chunk goes in one request with its CRC32C, no session") {
  const std::string name = UniqueName("once");
  const std::string data = Bytes(kQ, 4);  // exactly one chunk
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  std::atomic<uint64_t> progress{100};  // shared with other uploads: this one adds its bytes
  UploadSource src;
  src.pieces = {{data.data(), 1000}, {data.data() + 1000, data.size() - 1000}};
  src.size = data.size();
  src.crc32c = &crc;
  src.progress = &progress;
  auto meta = Run(client->Upload(bucket, name, &src));
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(meta->crc32c == crc);
  CHECK(progress == 100 + data.size());
  CHECK(control->Count("POST", "uploadType=media") == 1);
  CHECK(control->Count("POST", "uploadType=resumable") == 0);
  CHECK(control->Count("PUT", "upload_id=") == 0);
  CHECK(control->BodyBytes("POST", "uploadType=media") == data.size());
  CHECK(ReadBack(name, data.size()) == data);
}

// Sets *crc and the event after a short sleep: a CRC still being computed.
Task<void> CrcLater(runtime::Loop* loop, uint32_t* crc, uint32_t value, runtime::AsyncEvent* ready) {
  Status slept = co_await loop->Sleep(std::chrono::milliseconds(20));
  slept.IgnoreError();
  *crc = value;
  ready->Set();
}

TEST_CASE_FIXTURE(Fixture, "a one-request upload whose CRC32C comes late is checked against the stored CRC after") {
  const std::string data = Bytes(kQ / 2, 5);
  const uint32_t right = format::Crc32c(data.data(), data.size());
  for (bool corrupt : {false, true}) {
    uint32_t crc = 0;
    runtime::AsyncEvent ready;
    UploadSource src;
    src.pieces = {{data.data(), data.size()}};
    src.size = data.size();
    src.crc32c = &crc;
    src.crc_ready = &ready;
    const std::string name = UniqueName(corrupt ? "late-bad" : "late");
    Task<Result<ObjectMeta>> upload = client->Upload(bucket, name, &src);
    Task<void> later = CrcLater(loop.get(), &crc, corrupt ? right ^ 1 : right, &ready);
    auto both = WhenAll(std::move(upload), std::move(later));
    auto [meta, done] = Run(std::move(both));
    (void)done;
    if (!corrupt) {
      REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
      CHECK(meta->crc32c == right);
    } else {
      CHECK(meta.status().code() == StatusCode::kCorruption);
      CHECK(meta.status().message().find("the server stored CRC32C") != std::string::npos);
      CHECK(meta.status().message().find(name) != std::string::npos);
    }
  }
}

TEST_CASE_FIXTURE(Fixture, "an upload with a wrong CRC32C is refused by the server with its message") {
  const std::string data = Bytes(2 * kQ, 2);
  const uint32_t wrong = format::Crc32c(data.data(), data.size()) ^ 1;
  auto meta = Upload(UniqueName("badcrc"), data, &wrong);
  CHECK(meta.status().code() == StatusCode::kInvalidArgument);
  CHECK(meta.status().message().find("HTTP 400") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "a 503 on a middle chunk is retried and only the missing chunk is sent again") {
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 3}, {"status", 503}}}));
  const std::string name = UniqueName("mid503");
  const std::string data = Bytes(6 * kQ, 3);
  auto meta = Upload(name, data);
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(control->BodyBytes("PUT", "upload_id=") == data.size() + kQ);  // the refused chunk, twice
  CHECK(client->stats().retries == 1);
  CHECK(client->stats().bytes_resent == kQ);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a 503 after the server committed a chunk sends nothing twice") {
  control->SetRules(Json::array(
      {{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 2}, {"status", 503}, {"after_forward", true}}}));
  const std::string name = UniqueName("after503");
  const std::string data = Bytes(4 * kQ, 4);
  REQUIRE(Upload(name, data).ok());
  CHECK(control->BodyBytes("PUT", "upload_id=") == data.size());
  CHECK(client->stats().bytes_resent == 0);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a reset in the middle of a chunk resends only the bytes the server lacks") {
  options.chunk_size = 4 * kQ;  // 1 MiB chunks
  UseAuth(std::move(auth));
  // 600000 bytes into the 2nd chunk the connection is reset; the server keeps
  // a 256 KiB-aligned prefix of what arrived (524288 bytes), says so when
  // queried, and the client sends from there.
  control->SetRules(Json::array(
      {{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 2}, {"reset_after_request_bytes", 600000}}}));
  const std::string name = UniqueName("reset");
  const std::string data = Bytes(10 * kQ + 999, 5);
  auto meta = Upload(name, data);
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  // What the reset request carried beyond what the server kept of it: the
  // server keeps a 256 KiB-aligned prefix of what reached it (2 x 256 KiB
  // usually; less when the proxy's reset beats the forwarding on a loaded
  // machine), and the client resends from exactly there.
  uint64_t kept = 0;  // from the session query's answer, "Range: bytes=0-N"
  uint64_t resent_from = 0;
  bool queried = false, resumed = false;
  for (const auto& e : control->Log()) {
    const std::string range = e["headers"].value("content-range", "");
    if (e.value("method", "") != "PUT") continue;
    if (range.rfind("bytes */", 0) == 0) {
      const std::string answer = e["response_headers"].value("range", "bytes=0--1");
      kept = std::stoull(answer.substr(answer.find('-') + 1)) + 1;
      queried = true;
    } else if (queried && !resumed) {
      resent_from = std::stoull(range.substr(6));
      resumed = true;
    }
  }
  REQUIRE(queried);
  REQUIRE(resumed);
  CHECK(resent_from == kept);
  CHECK(kept % kQ == 0);
  CHECK(kept >= 4 * kQ);                  // the whole first chunk
  CHECK(kept <= 4 * kQ + 600000);         // at most what reached the server
  CHECK(control->BodyBytes("PUT", "upload_id=") == data.size() + (4 * kQ + 600000 - kept));
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a stall past the stall timeout is abandoned and retried") {
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 1}, {"stall_seconds", 4}}}));
  const std::string name = UniqueName("stall");
  const std::string data = Bytes(2 * kQ, 6);
  auto meta = Upload(name, data);
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(client->stats().retries >= 1);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a 429 on the last chunk is retried") {
  control->SetRules(Json::array({{{"method", "PUT"},
                                  {"path", "upload_id="},
                                  {"headers", {{"Content-Range", "/\\d+$"}}},
                                  {"nth", 1},
                                  {"status", 429}}}));
  const std::string name = UniqueName("last429");
  const std::string data = Bytes(3 * kQ + 7, 7);
  REQUIRE(Upload(name, data).ok());
  CHECK(client->stats().retries == 1);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a session that expired (410) is started again from the first byte") {
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 2}, {"status", 503}},
                                 {{"method", "PUT"},
                                  {"headers", {{"Content-Range", "^bytes \\*/"}}},
                                  {"nth", 1},
                                  {"status", 410}}}));
  const std::string name = UniqueName("expired");
  const std::string data = Bytes(3 * kQ, 8);
  REQUIRE(Upload(name, data).ok());
  CHECK(client->stats().sessions_restarted == 1);
  CHECK(control->Count("POST", "uploadType=resumable") == 2);
  CHECK(ReadBack(name, data.size()) == data);
}

// An upload of `data` that stops, as a killed process would, once the
// server holds `chunks` chunks: the next chunk is refused (403, final). The
// session it recorded is returned.
std::string InterruptedUpload(Fixture& f, const std::string& name, const std::string& data, int chunks) {
  f.control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", chunks + 1}, {"status", 403}}}));
  std::string recorded;
  UploadSource src;
  src.pieces = {{data.data(), data.size()}};
  src.size = data.size();
  src.on_session = [&recorded](const std::string& session) {
    recorded = session;
    return Status::Ok();
  };
  REQUIRE(f.Run(f.client->Upload(f.bucket, name, &src)).status().code() == StatusCode::kPermissionDenied);
  f.control->Reset();
  REQUIRE(!recorded.empty());
  return recorded;
}

TEST_CASE_FIXTURE(Fixture, "an earlier process's session is asked, and only the bytes its server lacks are sent") {
  const std::string name = UniqueName("resumed");
  const std::string data = Bytes(6 * kQ + 777, 21);
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  const std::string session = InterruptedUpload(*this, name, data, 2);
  UploadSource src;
  src.pieces = {{data.data(), data.size()}};
  src.size = data.size();
  src.crc32c = &crc;
  src.resume_session = session;
  int recorded = 0;
  src.on_session = [&recorded](const std::string&) { return ++recorded, Status::Ok(); };
  auto meta = Run(client->Upload(bucket, name, &src));
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(meta->crc32c == crc);
  CHECK(control->Count("POST", "uploadType=resumable") == 0);
  CHECK(recorded == 0);
  CHECK(control->BodyBytes("PUT", "upload_id=") == data.size() - 2 * kQ);
  CHECK(client->stats().sessions_resumed == 1);
  CHECK(client->stats().bytes_resumed == 2 * kQ);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "an earlier process's session that completed its object sends nothing, if the object is there") {
  const std::string name = UniqueName("completed");
  const std::string data = Bytes(3 * kQ, 22);
  std::string session;
  UploadSource first;
  first.pieces = {{data.data(), data.size()}};
  first.size = data.size();
  first.on_session = [&session](const std::string& s) { return session = s, Status::Ok(); };
  REQUIRE(Run(client->Upload(bucket, name, &first)).ok());
  control->Reset();
  UploadSource again = first;
  again.resume_session = session;
  auto meta = Run(client->Upload(bucket, name, &again));
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(meta->size == data.size());
  CHECK(control->BodyBytes("PUT", "upload_id=") == 0);
  CHECK(control->Count("POST", "uploadType=resumable") == 0);
  CHECK(client->stats().bytes_resumed == data.size());
  // Deleted since: the completed session does not stand for it; sent again.
  REQUIRE(Run(client->Delete(bucket, name)).ok());
  control->Reset();
  REQUIRE(Run(client->Upload(bucket, name, &again)).ok());
  CHECK(control->Count("POST", "uploadType=resumable") == 1);
  CHECK(control->BodyBytes("PUT", "upload_id=") == data.size());
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "an expired or foreign session is replaced by a new one, recorded before its first byte") {
  const std::string name = UniqueName("replaced");
  const std::string data = Bytes(2 * kQ + 5, 23);
  const std::string endpoint = Env("STORAGE_EMULATOR_HOST");
  for (const std::string& stale : {endpoint + "/upload/storage/v1/b/" + bucket + "/o?uploadType=resumable&upload_id=gone",
                                   std::string("http://127.0.0.1:9/upload/storage/v1/b/x/o?upload_id=elsewhere")}) {
    CAPTURE(stale);
    control->Reset();
    UploadSource src;
    src.pieces = {{data.data(), data.size()}};
    src.size = data.size();
    src.resume_session = stale;
    int puts_when_recorded = -1;
    src.on_session = [&](const std::string& session) {
      CHECK(session != stale);
      puts_when_recorded = control->Count("PUT", "upload_id=") - control->Count("PUT", "upload_id=gone");
      return Status::Ok();
    };
    REQUIRE(Run(client->Upload(bucket, name, &src)).ok());
    CHECK(puts_when_recorded == 0);
    CHECK(control->Count("PUT", "upload_id=elsewhere") == 0);  // another endpoint's: never asked
    CHECK(ReadBack(name, data.size()) == data);
  }
  CHECK(client->stats().sessions_resumed == 0);
  CHECK(client->stats().sessions_restarted == 1);  // the expired one
}

TEST_CASE_FIXTURE(Fixture, "a session that cannot be recorded fails the upload before its first byte") {
  const std::string data = Bytes(2 * kQ, 24);
  UploadSource src;
  src.pieces = {{data.data(), data.size()}};
  src.size = data.size();
  src.on_session = [](const std::string&) { return ResourceExhaustedError("ROOT/.ckptio-replication.json: disk full"); };
  auto meta = Run(client->Upload(bucket, UniqueName("unrecorded"), &src));
  CHECK(meta.status().code() == StatusCode::kResourceExhausted);
  CHECK(meta.status().message().find("disk full") != std::string::npos);
  CHECK(control->Count("PUT", "upload_id=") == 0);
}

TEST_CASE_FIXTURE(Fixture, "gcs.max_upload_bandwidth: an upload's bytes do not go out faster than the cap") {
  options.max_upload_bandwidth = 4 * kQ;  // 1 MiB/s
  UseAuth(std::move(MakeAuth(*loop, *http, options, /*emulator=*/true)).value());
  const std::string name = UniqueName("paced");
  const std::string data = Bytes(6 * kQ, 25);
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(Upload(name, data).ok());
  const auto took = std::chrono::steady_clock::now() - start;
  // The last of the 6 chunks may start no sooner than 5 chunks' time at
  // the cap (1.25 s) after the first. (A lower bound: a loaded machine only
  // makes it longer.)
  CHECK(took >= std::chrono::milliseconds(1250));
  CHECK(control->Count("PUT", "upload_id=") == 6);
  CHECK(ReadBack(name, data.size()) == data);
}

// The final chunk's request, and a 200 whose object resource is cut after
// 100 bytes (framed as complete) once the server has committed the object.
Json CutFinalAnswer() {
  return {{"method", "PUT"}, {"path", "upload_id="}, {"headers", {{"Content-Range", "/\\d+$"}}},
          {"nth", 1},        {"truncate_response_body", 100}};
}

TEST_CASE_FIXTURE(Fixture, "a 200 cut short on the last chunk is confirmed by the stored object's size and CRC32C") {
  control->SetRules(Json::array({CutFinalAnswer()}));
  const std::string name = UniqueName("cut-final");
  const std::string data = Bytes(3 * kQ + 7, 13);
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  auto meta = Upload(name, data, &crc);
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(control->Fired() == 1);
  CHECK(meta->name == name);
  CHECK(meta->size == data.size());
  CHECK(meta->crc32c == crc);
  CHECK(control->Count("PUT", "upload_id=") == 4);  // nothing was sent again
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a 200 cut short on a one-request upload or a small upload is confirmed the same way") {
  control->SetRules(Json::array({{{"method", "POST"}, {"path", "uploadType=media"}, {"times", 2},
                                  {"truncate_response_body", 100}}}));
  const std::string name = UniqueName("cut-once");
  const std::string data = Bytes(kQ / 2, 14);
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  auto once = Upload(name, data, &crc);
  REQUIRE_MESSAGE(once.ok(), once.status().ToString());
  CHECK(once->size == data.size());
  CHECK(once->crc32c == crc);
  const std::string manifest = UniqueName("cut-small");
  auto small = Run(client->UploadSmall(bucket, manifest, "{\"step\": 3}", 0));
  REQUIRE_MESSAGE(small.ok(), small.status().ToString());
  CHECK(small->size == 11);
  CHECK(control->Fired() == 2);
  CHECK(control->Count("POST", "uploadType=media") == 2);  // neither was sent twice
  CHECK(ReadBack(name, data.size()) == data);
  CHECK(ReadBack(manifest, 11) == "{\"step\": 3}");
}

TEST_CASE_FIXTURE(Fixture, "a broken 200 on the last chunk fails naming the object when another object is stored") {
  const std::string name = UniqueName("cut-not-ours");
  REQUIRE(Run(client->UploadSmall(bucket, name, "someone else's", {})).ok());
  // The final chunk never reaches the server, whose "200" is a broken body.
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"headers", {{"Content-Range", "/\\d+$"}}},
                                  {"status", 200}, {"body", "{\"kind\": \"storage#object\", \"na"}}}));
  const std::string data = Bytes(2 * kQ + 5, 15);
  const uint32_t crc = format::Crc32c(data.data(), data.size());
  auto meta = Upload(name, data, &crc);
  CHECK(meta.status().code() == StatusCode::kCorruption);
  const std::string& m = meta.status().message();
  CHECK(m.find("upload " + GsUrl(bucket, name)) != std::string::npos);
  CHECK(m.find("not an object resource") != std::string::npos);
  CHECK(m.find("holds 14 bytes") != std::string::npos);
  CHECK(m.find("not the " + std::to_string(data.size()) + " bytes") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "a broken 200 on the last chunk fails naming the object when nothing is stored") {
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"headers", {{"Content-Range", "/\\d+$"}}},
                                  {"status", 200}, {"body", "{\"kind\": \"storage#object\", \"na"}}}));
  const std::string name = UniqueName("cut-nothing");
  auto meta = Upload(name, Bytes(2 * kQ + 5, 16));
  CHECK(meta.status().code() == StatusCode::kUnavailable);
  const std::string& m = meta.status().message();
  CHECK(m.find("upload " + GsUrl(bucket, name)) != std::string::npos);
  CHECK(m.find("not an object resource") != std::string::npos);
  CHECK(m.find("does not exist") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "retries stop at max_attempts with the server's message and the count") {
  options.retry.max_attempts = 3;
  UseAuth(std::move(auth));
  control->SetRules(Json::array(
      {{{"method", "POST"}, {"path", "uploadType="}, {"status", 503}, {"message", "backend sad"}}}));
  // A one-request upload (it fits a chunk) and a resumable session's start.
  for (const std::string& data : {std::string("abc"), Bytes(2 * kQ + 1, 3)}) {
    control->Reset();
    control->SetRules(Json::array(
        {{{"method", "POST"}, {"path", "uploadType="}, {"status", 503}, {"message", "backend sad"}}}));
    auto meta = Upload(UniqueName("exhausted"), data);
    CHECK(meta.status().code() == StatusCode::kUnavailable);
    CHECK(meta.status().message().find("HTTP 503: backend sad") != std::string::npos);
    CHECK(meta.status().message().find("gave up after 3 attempts") != std::string::npos);
    CHECK(control->Count("POST", data.size() > kQ ? "uploadType=resumable" : "uploadType=media") == 3);
  }
}

TEST_CASE_FIXTURE(Fixture, "a 403 fails at once with the server's message") {
  control->SetRules(Json::array(
      {{{"method", "POST"}, {"path", "uploadType=media"}, {"status", 403}, {"message", "no access here"}}}));
  auto meta = Upload(UniqueName("forbidden"), "abc");
  CHECK(meta.status().code() == StatusCode::kPermissionDenied);
  CHECK(meta.status().message().find("HTTP 403: no access here") != std::string::npos);
  CHECK(control->Count("POST", "uploadType=media") == 1);
}

TEST_CASE_FIXTURE(Fixture, "a response cut short on a ranged read is retried") {
  const std::string name = UniqueName("cut");
  const std::string data = Bytes(3 * kQ, 9);
  REQUIRE(Upload(name, data).ok());
  control->SetRules(Json::array({{{"method", "GET"}, {"path", "alt=media"}, {"nth", 1}, {"cut_response_after", 1000}}}));
  std::string part(2 * kQ, '\0');
  Status s = Run(client->Read(bucket, name, 1000, part.size(), part.data(), data.size()));
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(part == data.substr(1000, part.size()));
  CHECK(client->stats().retries == 1);
}

TEST_CASE_FIXTURE(Fixture, "corrupted bytes on a whole-object read fail the x-goog-hash check") {
  const std::string name = UniqueName("corrupt");
  const std::string data = Bytes(kQ, 10);
  REQUIRE(Upload(name, data).ok());
  control->SetRules(Json::array({{{"method", "GET"}, {"path", "alt=media"}, {"corrupt_response_byte", 777}}}));
  std::string out(data.size(), '\0');
  Status s = Run(client->Read(bucket, name, 0, out.size(), out.data(), out.size()));
  CHECK(s.code() == StatusCode::kCorruption);
  CHECK(s.message().find("the server says") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "a small object is read whole in one GET, bounded, and its CRC32C checked") {
  const std::string name = UniqueName("small");
  const std::string data = Bytes(3 * kQ + 5, 11);
  REQUIRE(Upload(name, data).ok());
  const uint64_t before = client->stats().requests;
  auto got = Run(client->ReadAll(bucket, name, data.size()));
  REQUIRE_MESSAGE(got.ok(), got.status().ToString());
  CHECK(*got == data);
  CHECK(client->stats().requests - before == 1);
  // One byte more than allowed: refused, naming the object and the limit.
  auto big = Run(client->ReadAll(bucket, name, data.size() - 1));
  CHECK(big.status().code() == StatusCode::kCorruption);
  CHECK(big.status().message().find(name) != std::string::npos);
  CHECK(big.status().message().find("more than the " + std::to_string(data.size() - 1) + " bytes allowed") !=
        std::string::npos);
  // Far more than allowed (the server streams 3 MiB, 1 KiB allowed): the
  // transfer is cut off, not buffered whole.
  const std::string large = Bytes(12 * kQ, 12);
  const std::string large_name = UniqueName("large");
  REQUIRE(Upload(large_name, large).ok());
  auto cut = Run(client->ReadAll(bucket, large_name, 1024));
  CHECK(cut.status().code() == StatusCode::kCorruption);
  CHECK(cut.status().message().find("more than the 1024 bytes allowed") != std::string::npos);
  // Corrupted on the way: the x-goog-hash check fails.
  control->SetRules(Json::array({{{"method", "GET"}, {"path", "alt=media"}, {"corrupt_response_byte", 100}}}));
  auto corrupt = Run(client->ReadAll(bucket, name, data.size()));
  CHECK(corrupt.status().code() == StatusCode::kCorruption);
  CHECK(corrupt.status().message().find("the server says") != std::string::npos);
  // Missing: NotFound, as before.
  control->SetRules(Json::array());
  CHECK(Run(client->ReadAll(bucket, UniqueName("absent"), 10)).status().code() == StatusCode::kNotFound);
}

TEST_CASE_FIXTURE(Fixture, "a small object with ifGenerationMatch=0 fails with AlreadyExists the second time") {
  const std::string name = UniqueName("manifest");
  REQUIRE(Run(client->UploadSmall(bucket, name, "{}", 0)).ok());
  auto again = Run(client->UploadSmall(bucket, name, "{\"other\": 1}", 0));
  CHECK(again.status().code() == StatusCode::kAlreadyExists);
  CHECK(ReadBack(name, 2) == "{}");
}

TEST_CASE_FIXTURE(Fixture, "a small upload whose answer was lost is recognised as ours on retry") {
  control->SetRules(Json::array(
      {{{"method", "POST"}, {"path", "uploadType=media"}, {"nth", 1}, {"status", 503}, {"after_forward", true}}}));
  const std::string name = UniqueName("lost-answer");
  auto meta = Run(client->UploadSmall(bucket, name, "{\"step\": 1}", 0));
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(ReadBack(name, 11) == "{\"step\": 1}");
}

TEST_CASE_FIXTURE(Fixture, "a list that needs paging returns every object once") {
  const std::string dir = UniqueName("list") + "/";
  std::vector<Task<Result<ObjectMeta>>> uploads;
  for (int i = 0; i < 25; ++i) uploads.push_back(client->UploadSmall(bucket, dir + "o" + std::to_string(100 + i), "x", {}));
  for (auto& r : Run(WhenAll(std::move(uploads)))) REQUIRE(r.ok());
  auto listed = Run(client->List(bucket, dir, "", /*page_size=*/7));
  REQUIRE_MESSAGE(listed.ok(), listed.status().ToString());
  CHECK(listed->pages == 4);
  REQUIRE(listed->objects.size() == 25);
  for (int i = 0; i < 25; ++i) CHECK(listed->objects[i].name == dir + "o" + std::to_string(100 + i));
  auto prefixes = Run(client->List(bucket, dir.substr(0, dir.find('/') + 1), "/"));
  REQUIRE(prefixes.ok());
  CHECK(std::find(prefixes->prefixes.begin(), prefixes->prefixes.end(), dir) != prefixes->prefixes.end());
}

TEST_CASE_FIXTURE(Fixture, "deleting an object makes it NotFound, and deleting it again succeeds") {
  const std::string name = UniqueName("del");
  REQUIRE(Run(client->UploadSmall(bucket, name, "x", {})).ok());
  REQUIRE(Run(client->Delete(bucket, name)).ok());
  CHECK(Run(client->Stat(bucket, name)).status().code() == StatusCode::kNotFound);
  CHECK(Run(client->Delete(bucket, name)).ok());
}

// ---- credentials ----

TEST_CASE_FIXTURE(Fixture, "a service-account key gets a token whose bearer the server accepts") {
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  control->Settings({{"require_bearer", "issued"}});
  const std::string name = UniqueName("sa");
  auto meta = Upload(name, Bytes(2 * kQ, 11));
  REQUIRE_MESSAGE(meta.ok(), meta.status().ToString());
  CHECK(auth->tokens_fetched() == 1);
  for (const auto& e : control->Log()) CHECK(e.value("bearer_ok", false));
}

TEST_CASE_FIXTURE(Fixture, "an authorized-user refresh token gets a token the server accepts") {
  UseAuth(std::move(AuthorizedUserAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_AUTHORIZED_USER")), "au.json"))
              .value());
  control->Settings({{"require_bearer", "issued"}});
  REQUIRE(Upload(UniqueName("au"), "data").ok());
  CHECK(auth->tokens_fetched() == 1);
}

TEST_CASE_FIXTURE(Fixture, "the metadata server gives a token the server accepts") {
  UseAuth(MetadataServerAuth(*loop, *http, options, Env("CKPTIO_TEST_METADATA_HOST")));
  control->Settings({{"require_bearer", "issued"}});
  REQUIRE(Upload(UniqueName("md"), "data").ok());
  CHECK(auth->tokens_fetched() == 1);
}

// Sets or unsets environment variables for the life of the object.
class ScopedEnv {
 public:
  void Set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        unsetenv(it->first.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A port on 127.0.0.1 that nothing listens on (bound, then closed).
int ClosedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST_CASE_FIXTURE(Fixture, "with no other credentials the metadata server's failure names every source tried") {
  ScopedEnv env;
  env.Set("GOOGLE_APPLICATION_CREDENTIALS", nullptr);
  const std::string host = "127.0.0.1:" + std::to_string(ClosedPort());
  env.Set("GCE_METADATA_HOST", host.c_str());
  options.retry.max_attempts = 1;
  UseAuth(std::move(MakeAuth(*loop, *http, options, /*emulator=*/false)).value());
  const std::string name = UniqueName("nocreds");
  auto stat = Run(client->Stat(bucket, name));
  CHECK(stat.status().code() == StatusCode::kUnavailable);
  const std::string& m = stat.status().message();
  CHECK(m.find("stat " + GsUrl(bucket, name)) != std::string::npos);
  CHECK(m.find("metadata server " + host) != std::string::npos);
  CHECK(m.find("STORAGE_EMULATOR_HOST") != std::string::npos);
  CHECK(m.find("GOOGLE_APPLICATION_CREDENTIALS") != std::string::npos);
  CHECK(m.find("GCE_METADATA_HOST") != std::string::npos);
  // Without GCE_METADATA_HOST, the default host is named as such (no request made here).
  env.Set("GCE_METADATA_HOST", nullptr);
  auto fallback = MakeAuth(*loop, *http, options, /*emulator=*/false);
  REQUIRE(fallback.ok());
  const std::string described = (*fallback)->Describe();
  CHECK(described.find("metadata.google.internal") != std::string::npos);
  CHECK(described.find("GCE_METADATA_HOST is not set") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "without a valid token the server's 401 is reported, after one refresh") {
  UseAuth(std::move(MakeAuth(*loop, *http, options, /*emulator=*/true)).value());  // sends no token
  control->Settings({{"require_bearer", "issued"}});
  auto meta = Upload(UniqueName("noauth"), "data");
  CHECK(meta.status().code() == StatusCode::kPermissionDenied);
  CHECK(meta.status().message().find("HTTP 401") != std::string::npos);
  CHECK(control->Count("POST", "uploadType=media") == 2);
}

TEST_CASE_FIXTURE(Fixture, "a 401 in the middle of an upload refreshes the token once and the upload completes") {
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  control->SetRules(Json::array({{{"method", "PUT"}, {"path", "upload_id="}, {"nth", 2}, {"status", 401}}}));
  const std::string name = UniqueName("mid401");
  const std::string data = Bytes(4 * kQ, 12);
  REQUIRE(Upload(name, data).ok());
  CHECK(auth->tokens_fetched() == 2);
  CHECK(ReadBack(name, data.size()) == data);
}

TEST_CASE_FIXTURE(Fixture, "a token is not sent to a plain http endpoint without gcs.allow_http_credentials") {
  options.allow_http_credentials = false;
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  const std::string name = UniqueName("plain-http");
  auto meta = Upload(name, "data");
  CHECK(meta.status().code() == StatusCode::kFailedPrecondition);
  const std::string& m = meta.status().message();
  CHECK(m.find("upload " + GsUrl(bucket, name)) != std::string::npos);
  CHECK(m.find("over plain http to " + Env("STORAGE_EMULATOR_HOST")) != std::string::npos);
  CHECK(m.find("gcs.allow_http_credentials") != std::string::npos);
  CHECK(auth->tokens_fetched() == 0);  // refused before a token was even fetched
  CHECK(control->Log().empty());       // and nothing reached the endpoint
  // Without credentials (an emulator) the same endpoint is used as before.
  UseAuth(std::move(MakeAuth(*loop, *http, options, /*emulator=*/true)).value());
  REQUIRE(Upload(name, "data").ok());
}

TEST_CASE_FIXTURE(Fixture, "a server error that echoes the request shows its words but not our token") {
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  control->SetRules(Json::array({{{"method", "POST"},
                                  {"path", "uploadType=media"},
                                  {"status", 400},
                                  {"message", "Invalid argument"},
                                  {"echo_request_headers", true}}}));
  auto meta = Upload(UniqueName("echo"), "data");
  REQUIRE(auth->tokens_fetched() == 1);  // a token was sent, and echoed
  CHECK(meta.status().code() == StatusCode::kInvalidArgument);
  const std::string& m = meta.status().message();
  CHECK(m.find("HTTP 400: Invalid argument; you sent: {") != std::string::npos);
  CHECK(m.find("'Authorization': 'Bearer <redacted>'") != std::string::npos);
  CHECK(m.find("ya29.") == std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "concurrent requests share one token fetch") {
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  control->Settings({{"require_bearer", "issued"}});
  const std::string dir = UniqueName("shared") + "/";
  std::vector<Task<Result<ObjectMeta>>> uploads;
  for (int i = 0; i < 20; ++i) uploads.push_back(client->UploadSmall(bucket, dir + std::to_string(i), "x", {}));
  for (auto& r : Run(WhenAll(std::move(uploads)))) CHECK(r.ok());
  CHECK(auth->tokens_fetched() == 1);
}

TEST_CASE_FIXTURE(Fixture, "a cached token is refreshed a minute before it expires, not sooner") {
  UseAuth(std::move(ServiceAccountAuth(*loop, *http, options, ReadFile(Env("CKPTIO_TEST_SA_KEY")), "sa.json")).value());
  // Time moves only when the test moves it. with_gcs.py's token server
  // issues tokens for an hour, so the refresh is due 3540 s after the fetch.
  auto now = std::chrono::steady_clock::now();
  dynamic_cast<TokenAuth&>(*auth).SetClockForTesting([&now] { return now; });
  control->Settings({{"require_bearer", "issued"}});
  const std::string dir = UniqueName("refresh") + "/";
  REQUIRE(Run(client->UploadSmall(bucket, dir + "fetched", "x", {})).ok());
  REQUIRE(auth->tokens_fetched() == 1);
  now += std::chrono::seconds(3540) - std::chrono::milliseconds(1);
  REQUIRE(Run(client->UploadSmall(bucket, dir + "cached", "x", {})).ok());
  CHECK(auth->tokens_fetched() == 1);
  now += std::chrono::milliseconds(1);
  REQUIRE(Run(client->UploadSmall(bucket, dir + "refreshed", "x", {})).ok());
  CHECK(auth->tokens_fetched() == 2);
}

}  // namespace
}  // namespace ckptio::gcs
