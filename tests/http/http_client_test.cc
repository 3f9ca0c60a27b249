// HttpClient against a real HTTP server on 127.0.0.1 (tests/http/test_server.py).

#include <doctest/doctest.h>
#include <openssl/evp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/when_all.h"
#include "http/http_client.h"
#include "runtime/loop.h"

namespace ckptio::http {
namespace {

// Starts tests/http/test_server.py and stops it at the end of the test.
class TestServer {
 public:
  TestServer() {
    const char* python = std::getenv("CKPTIO_TEST_PYTHON");
    const char* script = std::getenv("CKPTIO_HTTP_TEST_SERVER");
    REQUIRE_MESSAGE((python && script), "CKPTIO_TEST_PYTHON and CKPTIO_HTTP_TEST_SERVER must be set");
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      execl(python, python, script, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    FILE* out = fdopen(fds[0], "r");
    int port = 0;
    REQUIRE_MESSAGE(std::fscanf(out, "%d", &port) == 1, "the test server did not start");
    std::fclose(out);
    base_ = "http://127.0.0.1:" + std::to_string(port);
  }
  ~TestServer() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  std::string url(const std::string& path) const { return base_ + path; }

 private:
  pid_t pid_ = -1;
  std::string base_;
};

struct Fixture {
  Fixture() {
    auto l = runtime::Loop::Create();
    REQUIRE(l.ok());
    loop = std::move(l).value();
  }
  std::unique_ptr<HttpClient> Client(HttpOptions o = {}) {
    auto c = HttpClient::Create(*loop, o);
    REQUIRE(c.ok());
    return std::move(c).value();
  }
  Result<Response> Send(HttpClient& c, Request r) { return loop->Run(c.Send(std::move(r))); }

  TestServer server;
  std::unique_ptr<runtime::Loop> loop;
};

std::string Pattern(size_t n, size_t start = 0) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(((start + i) * 7) % 251);
  return s;
}

std::string Sha256Hex(const std::vector<BodyPiece>& pieces) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  for (const auto& p : pieces) EVP_DigestUpdate(ctx, p.data, p.len);
  unsigned char md[32];
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx, md, &n);
  EVP_MD_CTX_free(ctx);
  std::string hex;
  char b[3];
  for (unsigned i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", md[i]);
    hex += b;
  }
  return hex;
}

TEST_CASE_FIXTURE(Fixture, "a GET returns the status, the headers and the body") {
  auto c = Client();
  Request r;
  r.url = server.url("/bytes?n=100000");
  auto resp = Send(*c, r);
  REQUIRE_MESSAGE(resp.ok(), resp.status().ToString());
  CHECK(resp->status == 200);
  CHECK(resp->Header("content-length") == "100000");
  CHECK(resp->body == Pattern(100000));
}

TEST_CASE_FIXTURE(Fixture, "a PUT body read from several caller buffers arrives whole") {
  auto c = Client();
  std::string a = Pattern(40 << 20, 1), b = Pattern(3, 2), d = Pattern(25 << 20, 3);
  Request r;
  r.method = "PUT";
  r.url = server.url("/sink");
  r.pieces = {{a.data(), a.size()}, {b.data(), b.size()}, {d.data(), d.size()}};
  auto resp = Send(*c, r);
  REQUIRE_MESSAGE(resp.ok(), resp.status().ToString());
  auto j = nlohmann::json::parse(resp->body);
  CHECK(j["bytes"] == a.size() + b.size() + d.size());
  CHECK(j["sha256"] == Sha256Hex(r.pieces));
  CHECK(resp->bytes_sent == a.size() + b.size() + d.size());
}

TEST_CASE_FIXTURE(Fixture, "a POST with an in-memory body and an empty PUT both work") {
  auto c = Client();
  Request post;
  post.method = "POST";
  post.url = server.url("/sink");
  post.body = "hello";
  auto r1 = Send(*c, post);
  REQUIRE(r1.ok());
  CHECK(nlohmann::json::parse(r1->body)["bytes"] == 5);
  CHECK(nlohmann::json::parse(r1->body)["method"] == "POST");
  Request empty;
  empty.method = "PUT";
  empty.url = server.url("/sink");
  auto r2 = Send(*c, empty);
  REQUIRE(r2.ok());
  CHECK(nlohmann::json::parse(r2->body)["bytes"] == 0);
}

TEST_CASE_FIXTURE(Fixture, "a ranged GET lands straight in the caller's buffer") {
  auto c = Client();
  std::vector<char> buf(1000);
  Request r;
  r.url = server.url("/bytes?n=1000000");
  r.headers = {"Range: bytes=5000-5999"};
  r.response_buffer = buf.data();
  r.response_capacity = buf.size();
  auto resp = Send(*c, r);
  REQUIRE(resp.ok());
  CHECK(resp->status == 206);
  CHECK(resp->body.empty());
  CHECK(resp->body_bytes == 1000);
  CHECK(std::string(buf.begin(), buf.end()) == Pattern(1000, 5000));
}

TEST_CASE_FIXTURE(Fixture, "a response longer than the caller's buffer is an error, not an overflow") {
  auto c = Client();
  std::vector<char> buf(100);
  Request r;
  r.url = server.url("/bytes?n=5000");
  r.response_buffer = buf.data();
  r.response_capacity = buf.size();
  auto resp = Send(*c, r);
  CHECK(resp.status().code() == StatusCode::kCorruption);
  CHECK(resp.status().message().find("longer than the 100 bytes expected") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "an error status keeps its body for the message, even with a buffer") {
  auto c = Client();
  std::vector<char> buf(10);
  Request r;
  r.url = server.url("/status?code=503");
  r.response_buffer = buf.data();
  r.response_capacity = buf.size();
  auto resp = Send(*c, r);
  REQUIRE(resp.ok());
  CHECK(resp->status == 503);
  CHECK(resp->body.find("status 503 as asked") != std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "200 concurrent requests share at most max_connections reused connections") {
  HttpOptions o;
  o.max_connections = 4;
  auto c = Client(o);
  auto many = [](HttpClient* client, std::string url) -> Task<int> {
    std::vector<Task<Result<Response>>> sends;
    for (int i = 0; i < 200; ++i) {
      Request r;
      r.url = url;
      sends.push_back(client->Send(std::move(r)));
    }
    std::vector<Result<Response>> all = co_await WhenAll(std::move(sends));
    int ok = 0;
    for (auto& resp : all) ok += resp.ok() && resp->body == Pattern(4096);
    co_return ok;
  };
  CHECK(loop->Run(many(c.get(), server.url("/bytes?n=4096"))) == 200);
  Request stats;
  stats.url = server.url("/stats");
  auto s = Send(*c, stats);
  REQUIRE(s.ok());
  auto j = nlohmann::json::parse(s->body);
  CHECK(j["max_concurrent"].get<int>() <= 4);
  CHECK(j["connections"].get<int>() <= 4);
  CHECK(c->stats().requests == 201);
}

TEST_CASE_FIXTURE(Fixture, "a refused connection is Unavailable and names the method and URL") {
  auto c = Client();
  Request r;
  r.url = "http://127.0.0.1:1/nothing?secret=1";
  auto resp = Send(*c, r);
  CHECK(resp.status().code() == StatusCode::kUnavailable);
  CHECK(resp.status().message().find("GET http://127.0.0.1:1/nothing: ") == 0);
  CHECK(resp.status().message().find("secret") == std::string::npos);
}

TEST_CASE_FIXTURE(Fixture, "a server that stalls past the stall timeout gives DeadlineExceeded") {
  HttpOptions o;
  o.stall_timeout = std::chrono::milliseconds(1000);
  auto c = Client(o);
  Request r;
  r.url = server.url("/stall?s=60");  // far longer: the client gives up first, however loaded the machine
  auto resp = Send(*c, r);
  CHECK(resp.status().code() == StatusCode::kDeadlineExceeded);
}

TEST_CASE_FIXTURE(Fixture, "a request's time limit ends it long before the stall timeout would") {
  HttpOptions o;
  o.stall_timeout = std::chrono::minutes(10);
  auto c = Client(o);
  Request r;
  r.url = server.url("/stall?s=30");
  r.time_limit = std::chrono::milliseconds(300);
  auto resp = Send(*c, r);
  CHECK(resp.status().code() == StatusCode::kDeadlineExceeded);
  CHECK(resp.status().message().find("GET " + server.url("/stall") + ": not done within its time limit of 300 ms") ==
        0);
}

TEST_CASE_FIXTURE(Fixture, "a connection reset is Unavailable, and the next request still works") {
  auto c = Client();
  Request r;
  r.url = server.url("/reset");
  auto resp = Send(*c, r);
  CHECK(resp.status().code() == StatusCode::kUnavailable);
  Request ok;
  ok.url = server.url("/bytes?n=10");
  auto again = Send(*c, ok);
  REQUIRE(again.ok());
  CHECK(again->body == Pattern(10));
}

TEST_CASE_FIXTURE(Fixture, "destroying the client with idle pooled connections leaves nothing behind") {
  {
    auto c = Client();
    Request r;
    r.url = server.url("/bytes?n=10");
    REQUIRE(Send(*c, r).ok());
  }
  // The loop still holds the cancelled polls; running it lets them finish.
  auto drain = [](runtime::Loop* l) -> Task<void> {
    for (int i = 0; i < 10 && l->in_flight() > 1; ++i) co_await l->Yield();
  };
  loop->Run(drain(loop.get()));
  CHECK(loop->in_flight() == 1);  // only the loop's own wakeup read
}

}  // namespace
}  // namespace ckptio::http
