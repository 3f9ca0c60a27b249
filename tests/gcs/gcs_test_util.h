#pragma once
// For the C++ GCS tests, which run under tests/gcs/with_gcs.py: the
// environment it exports, and a client for the fault proxy's control API.

#include <doctest/doctest.h>

#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "http/http_client.h"
#include "runtime/loop.h"

namespace ckptio::testing {

inline std::string Env(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE_MESSAGE((v != nullptr && *v != '\0'), name << " is not set: run this test under tests/gcs/with_gcs.py");
  return v;
}

// The fault proxy's /__proxy/ API (tests/gcs/README.md), over our own client.
class ProxyControl {
 public:
  ProxyControl(runtime::Loop& loop, http::HttpClient& http) : loop_(loop), http_(http), base_(Env("CKPTIO_TEST_PROXY")) {}

  void SetRules(const nlohmann::json& rules) { Post("/__proxy/rules", rules); }
  void Settings(const nlohmann::json& settings) { Post("/__proxy/settings", settings); }
  void Reset() { Post("/__proxy/reset", nlohmann::json::object()); }
  // How many times the current rules fired.
  int Fired() {
    int n = 0;
    nlohmann::json rules = Get("/__proxy/rules");
    for (const auto& r : rules.is_array() ? rules : rules["rules"]) n += r.value("fired", 0);
    return n;
  }
  // Every request the proxy saw since the last Reset.
  nlohmann::json Log() { return Get("/__proxy/log")["entries"]; }

  // Request body bytes the proxy received for requests whose path contains `needle`.
  uint64_t BodyBytes(const std::string& method, const std::string& needle) {
    uint64_t total = 0;
    for (const auto& e : Log()) {
      std::string where = e.value("path", "") + "?" + e.value("query", "");
      if (e.value("method", "") == method && where.find(needle) != std::string::npos) {
        total += e.value("request_body_bytes", uint64_t{0});
      }
    }
    return total;
  }
  int Count(const std::string& method, const std::string& needle) {
    int n = 0;
    for (const auto& e : Log()) {
      std::string where = e.value("path", "") + "?" + e.value("query", "");
      n += e.value("method", "") == method && where.find(needle) != std::string::npos;
    }
    return n;
  }

 private:
  nlohmann::json Post(const std::string& path, const nlohmann::json& body) {
    http::Request r;
    r.method = "POST";
    r.url = base_ + path;
    r.headers = {"Content-Type: application/json"};
    r.body = body.dump();
    if (r.body.empty()) r.body = "{}";
    return Parse(loop_.Run(http_.Send(std::move(r))));
  }
  nlohmann::json Get(const std::string& path) {
    http::Request r;
    r.url = base_ + path;
    return Parse(loop_.Run(http_.Send(std::move(r))));
  }
  static nlohmann::json Parse(const Result<http::Response>& r) {
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    REQUIRE_MESSAGE(r->status == 200, "proxy control answered " << r->status << ": " << r->body);
    return nlohmann::json::parse(r->body);
  }

  runtime::Loop& loop_;
  http::HttpClient& http_;
  std::string base_;
};

}  // namespace ckptio::testing
