// The GCS fault matrix: every fault the proxy can inject, at every kind of
// request a checkpoint makes, through CheckpointManager on gs://. Each row
// must end in a correct, verified checkpoint (after retries) or in a clear
// error with nothing committed. Prints the matrix as a markdown table (the
// README's copy comes from it). Runs under tests/gcs/with_gcs.py.

#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "gcs_test_util.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

using Json = nlohmann::json;
using testing::Env;

enum class Action { kSave, kPrune, kList, kRestore };

struct Scenario {
  std::string fault;
  std::string where;
  Json rule;
  Action action;
  StatusCode expect = StatusCode::kOk;  // kOk: the operation succeeds and the data verifies
  bool service_account = false;         // real tokens, so that 401 means something
};

Json Rule(Json match, Json action) {
  for (auto& [k, v] : action.items()) match[k] = v;
  return match;
}

std::vector<Scenario> Scenarios() {
  const Json start = {{"method", "POST"}, {"path", "uploadType=resumable"}, {"nth", 1}};
  const Json middle = {{"method", "PUT"}, {"path", "upload_id="}, {"nth", 2}};
  const Json last = {{"method", "PUT"}, {"path", "upload_id="}, {"headers", {{"Content-Range", "/\\d+$"}}}, {"nth", 1}};
  const Json manifest = {{"method", "POST"}, {"path", "manifest\\.json"}, {"nth", 1}};
  const Json list = {{"method", "GET"}, {"path", "/o\\?prefix="}, {"nth", 1}};
  const Json del = {{"method", "DELETE"}, {"nth", 1}};
  const Json ranged = {{"method", "GET"}, {"path", "alt=media"}, {"headers", {{"Range", "bytes=4096-"}}}, {"nth", 1}};
  std::vector<Scenario> out;
  for (int status : {503, 429, 500}) {
    Json a = {{"status", status}};
    std::string f = "HTTP " + std::to_string(status);
    out.push_back({f, "resumable session start", Rule(start, a), Action::kSave});
    out.push_back({f, "a middle chunk", Rule(middle, a), Action::kSave});
    out.push_back({f, "the last chunk", Rule(last, a), Action::kSave});
    out.push_back({f, "the manifest (the commit)", Rule(manifest, a), Action::kSave});
    out.push_back({f, "list (open, recovery)", Rule(list, a), Action::kList});
    out.push_back({f, "delete (prune)", Rule(del, a), Action::kPrune});
    out.push_back({f, "a ranged read (restore)", Rule(ranged, a), Action::kRestore});
  }
  out.push_back({"HTTP 503 after the server committed", "a middle chunk",
                 Rule(middle, {{"status", 503}, {"after_forward", true}}), Action::kSave});
  out.push_back({"connection reset", "100 KB into a chunk", Rule(middle, {{"reset_after_request_bytes", 100000}}),
                 Action::kSave});
  out.push_back({"stall 4 s (stall timeout 1 s)", "a chunk", Rule(middle, {{"stall_seconds", 4}}), Action::kSave});
  out.push_back({"stall 4 s (stall timeout 1 s)", "a ranged read", Rule(ranged, {{"stall_seconds", 4}}),
                 Action::kRestore});
  out.push_back({"response cut short", "a ranged read", Rule(ranged, {{"cut_response_after", 1000}}), Action::kRestore});
  out.push_back({"session gone (410) when queried", "after a 503 on a chunk",
                 Json::array({Rule(middle, {{"status", 503}}),
                              Rule({{"method", "PUT"}, {"headers", {{"Content-Range", "^bytes \\*/"}}}, {"nth", 1}},
                                   {{"status", 410}})}),
                 Action::kSave});
  out.push_back({"HTTP 401 (token revoked)", "a middle chunk", Rule(middle, {{"status", 401}}), Action::kSave,
                 StatusCode::kOk, /*service_account=*/true});
  out.push_back({"corrupted bytes", "a ranged read",
                 {{"method", "GET"}, {"path", "alt=media"}, {"headers", {{"Range", "bytes=4096-"}}},
                  {"corrupt_response_byte", 100}},
                 Action::kRestore, StatusCode::kCorruption});
  out.push_back({"HTTP 503 on every attempt", "every chunk",
                 Rule({{"method", "PUT"}, {"path", "upload_id="}}, {{"status", 503}}), Action::kSave,
                 StatusCode::kUnavailable});
  out.push_back({"HTTP 403", "resumable session start", Rule(start, {{"status", 403}}), Action::kSave,
                 StatusCode::kPermissionDenied});
  return out;
}

const char* Name(StatusCode c) { return c == StatusCode::kOk ? "verified checkpoint" : StatusCodeName(c); }

Options MatrixOptions(const std::string& endpoint) {
  Options o = testing::SmallOptions(32 << 20);
  o.gcs.endpoint = endpoint;
  o.gcs.chunk_size = 256 << 10;
  o.gcs.retry.max_attempts = 4;
  o.gcs.retry.initial_backoff = std::chrono::milliseconds(5);
  o.gcs.retry.max_backoff = std::chrono::milliseconds(50);
  o.gcs.timeouts.stall = std::chrono::milliseconds(1000);
  return o;
}

// Runs one scenario; returns the outcome's status (OK only if the data was
// also checked: committed and verified, listed, pruned, or restored bit-exact).
Status Run(const Scenario& s, testing::ProxyControl& proxy, const std::string& root, const Options& base,
           int* fired) {
  auto state = testing::MakeState(2, 3, 300'000);  // 3.6 MB: several shards of several chunks
  auto refs = testing::Refs(state);
  Options o = base;
  o.keep = s.action == Action::kPrune ? 1 : 0;
  auto m = CheckpointManager::Open(root, o);
  if (!m.ok()) return m.status();
  if (s.action != Action::kSave) {  // the faults hit later requests
    if (Status st = (*m)->Save(1, refs)->Wait(); !st.ok()) return st;
  }
  proxy.SetRules(s.rule.is_array() ? s.rule : Json::array({s.rule}));
  switch (s.action) {
    case Action::kSave: {
      auto h = (*m)->Save(2, refs);
      if (!h.ok()) return h.status();
      Status st = h->Wait();
      *fired = proxy.Fired();
      if (!st.ok()) return st;
      proxy.Reset();
      return (*m)->Verify(2).status();
    }
    case Action::kPrune: {
      if (Status st = (*m)->Save(2, refs)->Wait(); !st.ok()) return st;
      if (Status st = (*m)->WaitUntilFinished(); !st.ok()) return st;
      *fired = proxy.Fired();
      return (*m)->AllSteps() == std::vector<int64_t>{2} ? Status::Ok() : InternalError("step 1 not pruned");
    }
    case Action::kList: {
      m->reset();
      auto again = CheckpointManager::Open(root, o);  // lists the root
      *fired = proxy.Fired();
      if (!again.ok()) return again.status();
      return (*again)->AllSteps() == std::vector<int64_t>{1} ? Status::Ok() : InternalError("step 1 not listed");
    }
    case Action::kRestore: {
      auto r = (*m)->Restore(1);
      *fired = proxy.Fired();
      if (!r.ok()) return r.status();
      for (size_t i = 0; i < state.size(); ++i) {
        if (r->tensors[i].bytes != state[i].bytes) return InternalError("restored bytes differ");
      }
      return Status::Ok();
    }
  }
  return InternalError("unknown action");
}

TEST_CASE("the GCS fault matrix: every fault ends in a verified checkpoint or a clear error with nothing committed") {
  auto loop = std::move(runtime::Loop::Create()).value();
  auto http = std::move(http::HttpClient::Create(*loop, {})).value();
  testing::ProxyControl proxy(*loop, *http);
  const std::string endpoint = Env("STORAGE_EMULATOR_HOST");
  const std::string bucket = Env("CKPTIO_TEST_BUCKET");
  std::string table = "| fault | on | expected | outcome |\n|---|---|---|---|\n";
  int passed = 0, total = 0;
  for (const Scenario& s : Scenarios()) {
    CAPTURE(s.fault);
    CAPTURE(s.where);
    proxy.Reset();
    // Service-account runs go through gcs.endpoint with real tokens (no
    // STORAGE_EMULATOR_HOST, which means "no credentials").
    if (s.service_account) {
      unsetenv("STORAGE_EMULATOR_HOST");
      setenv("GOOGLE_APPLICATION_CREDENTIALS", Env("CKPTIO_TEST_SA_KEY").c_str(), 1);
    }
    const std::string root = "gs://" + bucket + "/matrix-" + std::to_string(total) + "-" +
                             std::to_string(std::random_device{}() % 100000);
    int fired = 0;
    Options options = MatrixOptions(s.service_account ? endpoint : "");
    options.gcs.allow_http_credentials = s.service_account;  // tokens to the proxy, plain http on 127.0.0.1
    Status st = Run(s, proxy, root, options, &fired);
    if (s.service_account) {
      setenv("STORAGE_EMULATOR_HOST", endpoint.c_str(), 1);
      unsetenv("GOOGLE_APPLICATION_CREDENTIALS");
    }
    proxy.Reset();
    CHECK_MESSAGE(fired > 0, s.fault << " on " << s.where << ": the fault was never injected");
    bool ok = st.code() == s.expect && fired > 0;
    if (ok && s.expect != StatusCode::kOk && s.action == Action::kSave) {
      // A failed save commits nothing: step 2 has no manifest.
      auto m = CheckpointManager::OpenReadOnly(root, MatrixOptions(""));
      ok = m.ok() && (*m)->AllSteps().empty();
    }
    CHECK_MESSAGE(ok, s.fault << " on " << s.where << ": " << st.ToString());
    ++total;
    passed += ok;
    std::string outcome = st.ok() ? "verified checkpoint" : std::string(StatusCodeName(st.code())) + ", nothing committed";
    table += "| " + s.fault + " | " + s.where + " | " + Name(s.expect) + " | " + (ok ? outcome : "FAILED: " + st.ToString()) + " |\n";
  }
  std::printf("\n%s\n%d of %d scenarios ended as expected\n", table.c_str(), passed, total);
}

}  // namespace
}  // namespace ckptio
