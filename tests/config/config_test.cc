// The config file -> Options: each knob type, every kind of error naming the
// file and the key, loading from a path or $CKPTIO_CONFIG, and the defaults
// document / ToJson round trips.

#include <doctest/doctest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "config/config.h"
#include "config/knobs.h"
#include "test_util.h"

namespace ckptio::config {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;
using testing::WriteWholeFile;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

Options Parse(std::string_view text) {
  auto r = ParseConfig(text, "test.json");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  return *r;
}

// The message of the error ParseConfig returns, after checking it is one.
std::string ErrorOf(std::string_view text, std::string_view source = "test.json") {
  auto r = ParseConfig(text, source);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

bool Contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

// Sets, then restores, an environment variable for one test case.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// ---- Defaults and each knob type ----

TEST_CASE("default Options hold the documented defaults") {
  Options o;
  CHECK(o.staging_memory == 0);  // "auto": grows to what the saves need
  CHECK(o.shard_size == 256 * kMiB);
  CHECK(o.snapshot == SnapshotMode::kCopy);
  CHECK(o.on_busy == OnBusy::kWait);
  CHECK(o.max_in_flight == 2);
  CHECK(o.keep == 3);
  CHECK(o.keep_every == 0);
  CHECK(o.prefix == "checkpoint_");
  CHECK(o.io.block_size == 4 * kMiB);
  CHECK(o.io.direct == Options::Io::Direct::kAuto);
  CHECK(o.gcs.chunk_size == 16 * kMiB);
  CHECK(o.gcs.retry.max_attempts == 6);
  CHECK(o.gcs.retry.deadline == 300s);
  CHECK(o.gcs.http_version == "1.1");
  CHECK(o.preemption.grace == 30s);
}

TEST_CASE("an empty object yields the default Options") {
  CHECK(Parse("{}") == Options{});
}

TEST_CASE("the defaults pass validation") {
  CHECK(ValidateOptions(Options{}).ok());
}

TEST_CASE("a file overrides only the keys it sets") {
  Options o = Parse(R"({"keep": 5})");
  Options expected;
  expected.keep = 5;
  CHECK(o == expected);
}

TEST_CASE("a size knob takes a number of bytes or a string with a unit") {
  CHECK(Parse(R"({"shard_size": 1048576})").shard_size == kMiB);
  CHECK(Parse(R"({"shard_size": "512MiB"})").shard_size == 512 * kMiB);
  CHECK(Parse(R"({"shard_size": "16MB"})").shard_size == 16000000);
  CHECK(Parse(R"({"shard_size": "64 KiB"})").shard_size == 64 * 1024);
  CHECK(Parse(R"({"shard_size": 1e6})").shard_size == 1000000);
}

TEST_CASE("integer knobs take JSON integers") {
  Options o = Parse(R"({"max_in_flight": 4, "keep": 0, "keep_every": 10000, "threads": 8})");
  CHECK(o.max_in_flight == 4);
  CHECK(o.keep == 0);
  CHECK(o.keep_every == 10000);
  CHECK(o.threads == 8);
}

TEST_CASE("boolean knobs take true and false") {
  Options o = Parse(R"({"overwrite": true, "io": {"register_buffers": false}})");
  CHECK(o.overwrite);
  CHECK_FALSE(o.io.register_buffers);
}

TEST_CASE("string knobs take strings, the empty one included") {
  Options o = Parse(R"({"prefix": "", "trace": {"path": "/tmp/t.json"},
                        "gcs": {"user_project": "my-project", "http_version": "2"}})");
  CHECK(o.prefix == "");
  CHECK(o.trace.path == "/tmp/t.json");
  CHECK(o.gcs.user_project == "my-project");
  CHECK(o.gcs.http_version == "2");
}

TEST_CASE("snapshot and on_busy take their named values") {
  Options o = Parse(R"({"snapshot": "borrow", "on_busy": "skip"})");
  CHECK(o.snapshot == SnapshotMode::kBorrow);
  CHECK(o.on_busy == OnBusy::kSkip);
}

TEST_CASE("io.direct takes \"auto\", true or false") {
  CHECK(Parse(R"({"io": {"direct": "auto"}})").io.direct == Options::Io::Direct::kAuto);
  CHECK(Parse(R"({"io": {"direct": true}})").io.direct == Options::Io::Direct::kOn);
  CHECK(Parse(R"({"io": {"direct": false}})").io.direct == Options::Io::Direct::kOff);
}

TEST_CASE("a duration knob takes a string with a unit or a number of seconds") {
  CHECK(Parse(R"({"preemption": {"grace": "2m"}})").preemption.grace == 2min);
  CHECK(Parse(R"({"preemption": {"grace": "100ms"}})").preemption.grace == 100ms);
  CHECK(Parse(R"({"preemption": {"grace": 45}})").preemption.grace == 45s);
  CHECK(Parse(R"({"preemption": {"grace": 0.25}})").preemption.grace == 250ms);
}

TEST_CASE("knobs nested two levels deep are set") {
  Options o = Parse(R"({"gcs": {"retry": {"max_attempts": 3, "initial_backoff": "50ms"},
                                "timeouts": {"stall": "2m"}}})");
  CHECK(o.gcs.retry.max_attempts == 3);
  CHECK(o.gcs.retry.initial_backoff == 50ms);
  CHECK(o.gcs.retry.max_backoff == 10s);  // a sibling left out keeps its default
  CHECK(o.gcs.timeouts.stall == 2min);
}

TEST_CASE("gcs.headers takes an object of names to string values") {
  Options o = Parse(R"({"gcs": {"headers": {"X-Goog-Custom": "a", "Authorization": "Bearer t"}}})");
  CHECK(o.gcs.headers == std::map<std::string, std::string>{{"Authorization", "Bearer t"},
                                                            {"X-Goog-Custom", "a"}});
}

TEST_CASE("line and block comments are accepted") {
  Options o = Parse(R"(// tuned for the v3-128 pod
    {
      /* twice the default */ "max_in_flight": 4,  // background saves
      "io": { /* nested */ "queue_depth": 16 }
    })");
  CHECK(o.max_in_flight == 4);
  CHECK(o.io.queue_depth == 16);
}

// ---- Errors: each names the file and the key ----

TEST_CASE("a value of the wrong type names the file, key, expectation and value") {
  CHECK(ErrorOf(R"({"gcs": {"retry": {"max_attempts": "three"}}})", "/etc/ckptio.json") ==
        "config /etc/ckptio.json: key \"gcs.retry.max_attempts\": expected an integer, got "
        "string \"three\"");
  CHECK(ErrorOf(R"({"overwrite": "yes"})") ==
        "config test.json: key \"overwrite\": expected true or false, got string \"yes\"");
  CHECK(ErrorOf(R"({"prefix": 7})") ==
        "config test.json: key \"prefix\": expected a string, got number 7");
  CHECK(ErrorOf(R"({"keep": 2.5})") ==
        "config test.json: key \"keep\": expected an integer, got number 2.5");
}

TEST_CASE("a malformed size names the key and the bad unit") {
  CHECK(ErrorOf(R"({"io": {"block_size": "4XB"}})") ==
        "config test.json: key \"io.block_size\": invalid size \"4XB\": unknown unit \"XB\" "
        "(expected B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB or PB)");
  CHECK(Contains(ErrorOf(R"({"shard_size": -5})"),
                 "key \"shard_size\": expected a size (a number of bytes, or a string like "
                 "\"256MiB\"), got number -5"));
}

TEST_CASE("a malformed or sub-millisecond duration names the key") {
  CHECK(ErrorOf(R"({"gcs": {"timeouts": {"connect": "10 parsecs"}}})") ==
        "config test.json: key \"gcs.timeouts.connect\": invalid duration \"10 parsecs\": "
        "unknown unit \"parsecs\" (expected h, m, s, ms, us or ns)");
  CHECK(ErrorOf(R"({"preemption": {"grace": "250us"}})") ==
        "config test.json: key \"preemption.grace\": must be a whole number of milliseconds, "
        "got 250us");
  CHECK(Contains(ErrorOf(R"({"preemption": {"grace": true}})"),
                 "key \"preemption.grace\": expected a duration"));
}

TEST_CASE("an enum value outside its choices lists the choices") {
  CHECK(ErrorOf(R"({"snapshot": "cpy"})") ==
        "config test.json: key \"snapshot\": expected \"copy\", \"borrow\" or \"background\", got string \"cpy\"");
  CHECK(ErrorOf(R"({"io": {"direct": "on"}})") ==
        "config test.json: key \"io.direct\": expected \"auto\", true or false, got string "
        "\"on\"");
}

TEST_CASE("an unknown key is named with its path and the nearest known key") {
  CHECK(ErrorOf(R"({"io": {"blocksize": "4MiB"}})", "x.json") ==
        "config x.json: unknown key \"io.blocksize\" (did you mean \"io.block_size\"?)");
  CHECK(ErrorOf(R"({"gcs": {"retry": {"max_attemps": 3}}})") ==
        "config test.json: unknown key \"gcs.retry.max_attemps\" (did you mean "
        "\"gcs.retry.max_attempts\"?)");
}

TEST_CASE("a known key in the wrong group suggests where it belongs") {
  CHECK(ErrorOf(R"({"chunk_size": "8MiB"})") ==
        "config test.json: unknown key \"chunk_size\" (did you mean \"gcs.chunk_size\"?)");
}

TEST_CASE("an unknown key with no near match lists the keys of its group") {
  CHECK(ErrorOf(R"({"trace": {"file": "t.json"}})") ==
        "config test.json: unknown key \"trace.file\"; the keys in \"trace\" are: path");
}

TEST_CASE("a dotted key is refused rather than read as a path") {
  CHECK(Contains(ErrorOf(R"({"io.block_size": "4MiB"})"),
                 "key \"io.block_size\": dotted keys are not supported"));
}

TEST_CASE("a group given a non-object names the group") {
  CHECK(ErrorOf(R"({"gcs": {"retry": 3}})") ==
        "config test.json: key \"gcs.retry\": expected an object, got number 3");
}

TEST_CASE("a key set twice in one object is an error") {
  CHECK(ErrorOf("{\"io\": {\"queue_depth\": 4, \"queue_depth\": 8}}") ==
        "config test.json: key \"io.queue_depth\" is set twice");
}

TEST_CASE("invalid JSON names the file and the line and column") {
  const std::string message = ErrorOf("{\n  \"keep\": 3,\n  \"prefix\": nope\n}", "bad.json");
  CHECK(Contains(message, "config bad.json: invalid JSON: parse error at line 3, column"));
  CHECK_FALSE(Contains(message, "[json.exception"));
}

TEST_CASE("JSON nested deeper than 32 levels is refused while it is parsed") {
  // Found by tests/fuzz/fuzz_config: 20,000 '[' under an enum knob
  // overflowed the stack when the error message printed the value.
  const std::string deep = R"({"snapshot": )" + std::string(20000, '[') + std::string(20000, ']') + "}";
  CHECK(ErrorOf(deep) == "config test.json: invalid JSON: nests deeper than 32 levels");
  const std::string at_limit = R"({"snapshot": )" + std::string(31, '[') + std::string(31, ']') + "}";
  CHECK(Contains(ErrorOf(at_limit), "config test.json: key \"snapshot\": "));
}

TEST_CASE("a NUL byte in trace.path is refused, not cut short") {
  CHECK(ErrorOf(std::string(R"({"trace": {"path": "/tmp/t\u0000.json"}})")) ==
        "config test.json: key \"trace.path\": must not contain control characters");
}

TEST_CASE("a top level that is not an object is an error") {
  CHECK(ErrorOf("[1, 2]") ==
        "config test.json: expected a JSON object ({...}) at the top level, got array");
}

// ---- Semantic checks, one rule per case ----

TEST_CASE("staging_memory below 1 MiB is refused") {
  CHECK(ErrorOf(R"({"staging_memory": "512KiB"})") ==
        "config test.json: key \"staging_memory\": must be at least 1MiB, got 512KiB");
}

TEST_CASE("a zero shard_size is refused") {
  CHECK(ErrorOf(R"({"shard_size": 0})") ==
        "config test.json: key \"shard_size\": must be at least 1B, got 0B");
}

TEST_CASE("gcs.chunk_size must be a multiple of 256 KiB") {
  CHECK(ErrorOf(R"({"gcs": {"chunk_size": "1MB"}})") ==
        "config test.json: key \"gcs.chunk_size\": must be a multiple of 256KiB (GCS "
        "resumable uploads require it), got 1MB");
  CHECK(Parse(R"({"gcs": {"chunk_size": "768KiB"}})").gcs.chunk_size == 768 * 1024);
}

TEST_CASE("io.block_size must be a multiple of 4096") {
  CHECK(Contains(ErrorOf(R"({"io": {"block_size": 6000}})"),
                 "key \"io.block_size\": must be a multiple of 4KiB"));
}

TEST_CASE("a negative keep is refused") {
  CHECK(ErrorOf(R"({"keep": -1})") ==
        "config test.json: key \"keep\": must be at least 0, got -1");
}

TEST_CASE("max_in_flight must be at least 1") {
  CHECK(ErrorOf(R"({"max_in_flight": 0})") ==
        "config test.json: key \"max_in_flight\": must be between 1 and 1024, got 0");
}

TEST_CASE("gcs.connections must be between 1 and 1024") {
  CHECK(Contains(ErrorOf(R"({"gcs": {"connections": 0}})"), "key \"gcs.connections\""));
  CHECK(ErrorOf(R"({"gcs": {"connections": 5000}})") ==
        "config test.json: key \"gcs.connections\": must be between 1 and 1024, got 5000");
}

TEST_CASE("an integer too large for its field is refused, not truncated") {
  CHECK(ErrorOf(R"({"keep": 4294967299})") ==
        "config test.json: key \"keep\": must be at most 2147483647, got 4294967299");
  // Reported: 2^31 was answered with "must be at least 0".
  CHECK(ErrorOf(R"({"keep": 2147483648})") ==
        "config test.json: key \"keep\": must be at most 2147483647, got 2147483648");
  CHECK(ErrorOf(R"({"keep": 1e20})") == "config test.json: key \"keep\": must be at most 2147483647, got 1e+20");
  CHECK(ErrorOf(R"({"keep": 18446744073709551615})") ==
        "config test.json: key \"keep\": must be at most 2147483647, got 18446744073709551615");
  CHECK(ErrorOf(R"({"gcs": {"connections": 99999999999999999999}})") ==
        "config test.json: key \"gcs.connections\": must be between 1 and 1024, got 1e+20");
}

TEST_CASE("staging_memory is a size or \"auto\"") {
  CHECK(Parse(R"({"staging_memory": "auto"})").staging_memory == 0);
  CHECK(Parse(R"({"staging_memory": "3GiB"})").staging_memory == 3 * kGiB);
  CHECK(ErrorOf(R"({"staging_memory": "automatic"})").find("staging_memory") != std::string::npos);
}

TEST_CASE("gcs.http_version must be \"1.1\" or \"2\"") {
  CHECK(ErrorOf(R"({"gcs": {"http_version": "3"}})") ==
        "config test.json: key \"gcs.http_version\": expected \"1.1\" or \"2\", got \"3\"");
}

TEST_CASE("gcs.endpoint must be an http or https URL") {
  CHECK(Contains(ErrorOf(R"({"gcs": {"endpoint": "storage.googleapis.com"}})"),
                 "key \"gcs.endpoint\": expected an http:// or https:// URL"));
  CHECK(Contains(ErrorOf(R"({"gcs": {"endpoint": "https://"}})"), "key \"gcs.endpoint\""));
  CHECK(Parse(R"({"gcs": {"endpoint": "http://localhost:4443"}})").gcs.endpoint ==
        "http://localhost:4443");
}

TEST_CASE("a prefix containing a slash is refused") {
  CHECK(ErrorOf(R"({"prefix": "a/b"})") ==
        "config test.json: key \"prefix\": must not contain '/', got \"a/b\"");
}

TEST_CASE("a retry backoff that starts above its cap is refused") {
  CHECK(ErrorOf(R"({"gcs": {"retry": {"initial_backoff": "20s"}}})") ==
        "config test.json: key \"gcs.retry.initial_backoff\": must not exceed "
        "gcs.retry.max_backoff (10s), got 20s");
}

TEST_CASE("a zero gcs timeout is refused") {
  CHECK(ErrorOf(R"({"gcs": {"timeouts": {"stall": 0}}})") ==
        "config test.json: key \"gcs.timeouts.stall\": must be at least 1ms, got 0s");
}

TEST_CASE("headers that the upload protocol sets itself cannot be overridden") {
  CHECK(ErrorOf(R"({"gcs": {"headers": {"Content-Range": "bytes 0-1/2"}}})") ==
        "config test.json: key \"gcs.headers\": header \"Content-Range\" is set by ckptio on "
        "each request and cannot be overridden");
}

TEST_CASE("a header value with a line break is refused") {
  CHECK(Contains(ErrorOf(R"({"gcs": {"headers": {"X-A": "a\r\nHost: evil"}}})"),
                 "key \"gcs.headers\": header \"X-A\": value must not contain CR, LF or NUL"));
}

TEST_CASE("a header value that is not a string names the header") {
  CHECK(ErrorOf(R"({"gcs": {"headers": {"X-A": 1}}})") ==
        "config test.json: key \"gcs.headers\": header \"X-A\": expected a string, got number 1");
}

TEST_CASE("ValidateOptions rejects Options filled in code") {
  Options o;
  o.io.block_size = 6244;
  Status s = ValidateOptions(o);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() ==
        "key \"io.block_size\": must be a multiple of 4KiB (so that O_DIRECT writes stay "
        "aligned to the disk's blocks), got 6244B");
}

// ---- Files and the environment ----

TEST_CASE("LoadConfigFile reads and parses the file") {
  TempDir dir;
  WriteWholeFile(dir / "c.json", R"({"keep": 7})");
  auto r = LoadConfigFile(dir / "c.json");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(r->keep == 7);
}

TEST_CASE("errors in a loaded file name its path") {
  TempDir dir;
  WriteWholeFile(dir / "c.json", R"({"keep": "x"})");
  auto r = LoadConfigFile(dir / "c.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() ==
        "config " + (dir / "c.json") + ": key \"keep\": expected an integer, got string \"x\"");
}

TEST_CASE("a missing config file is an error naming the path and the errno text") {
  TempDir dir;
  auto r = LoadConfigFile(dir / "absent.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kNotFound);
  CHECK(r.status().message() ==
        "cannot open config file " + (dir / "absent.json") + ": No such file or directory");
}

TEST_CASE("a directory given as the config file is an error naming it") {
  TempDir dir;
  auto r = LoadConfigFile(dir.path());
  REQUIRE_FALSE(r.ok());
  CHECK(Contains(r.status().message(), "config file " + dir.path() + ": Is a directory"));
}

TEST_CASE("a config file over 1 MiB is refused") {
  TempDir dir;
  WriteWholeFile(dir / "big.json", "{" + std::string(2 * kMiB, ' ') + "}");
  auto r = LoadConfigFile(dir / "big.json");
  REQUIRE_FALSE(r.ok());
  CHECK(Contains(r.status().message(), "larger than 1MiB"));
}

TEST_CASE("LoadConfig with no path and no CKPTIO_CONFIG yields the defaults") {
  ScopedEnv env("CKPTIO_CONFIG", nullptr);
  auto r = LoadConfig("");
  REQUIRE(r.ok());
  CHECK(*r == Options{});
}

TEST_CASE("LoadConfig with no path reads the file named by CKPTIO_CONFIG") {
  TempDir dir;
  WriteWholeFile(dir / "env.json", R"({"on_busy": "skip"})");
  ScopedEnv env("CKPTIO_CONFIG", (dir / "env.json").c_str());
  auto r = LoadConfig("");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(r->on_busy == OnBusy::kSkip);
}

TEST_CASE("an explicit path wins over CKPTIO_CONFIG") {
  TempDir dir;
  WriteWholeFile(dir / "env.json", R"({"keep": 1})");
  WriteWholeFile(dir / "cli.json", R"({"keep": 2})");
  ScopedEnv env("CKPTIO_CONFIG", (dir / "env.json").c_str());
  auto r = LoadConfig(dir / "cli.json");
  REQUIRE(r.ok());
  CHECK(r->keep == 2);
}

TEST_CASE("a CKPTIO_CONFIG naming a missing file is an error that names the variable") {
  TempDir dir;
  ScopedEnv env("CKPTIO_CONFIG", (dir / "gone.json").c_str());
  auto r = LoadConfig("");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == "file named by $CKPTIO_CONFIG: cannot open config file " +
                                    (dir / "gone.json") + ": No such file or directory");
}

// ---- The defaults document and ToJson ----

TEST_CASE("the defaults document parses back into the default Options") {
  auto r = ParseConfig(DefaultsDocument(), "defaults");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(*r == Options{});
}

TEST_CASE("the defaults document puts a comment line before every key") {
  const std::string doc = DefaultsDocument();
  for (const Knob& knob : Knobs()) {
    const std::string_view leaf = knob.path.substr(knob.path.rfind('.') + 1);
    const size_t at = doc.find("\"" + std::string(leaf) + "\": ");
    CAPTURE(knob.path);
    REQUIRE(at != std::string::npos);
    const size_t line_start = doc.rfind('\n', at);
    const size_t previous_line = doc.rfind('\n', line_start - 1);
    const std::string comment = doc.substr(previous_line + 1, line_start - previous_line - 1);
    CHECK(Contains(comment, "// " + std::string(knob.description)));
  }
}

TEST_CASE("the defaults document writes sizes and durations in human form") {
  const std::string doc = DefaultsDocument();
  CHECK(Contains(doc, "\"staging_memory\": \"auto\""));
  CHECK(Contains(doc, "\"shard_size\": \"256MiB\""));
  CHECK(Contains(doc, "\"grace\": \"30s\""));
  CHECK(Contains(doc, "\"initial_backoff\": \"200ms\""));
}

TEST_CASE("ToJson is strict JSON that parses back to the same Options") {
  Options o;
  o.staging_memory = 8 * kGiB;
  o.shard_size = 100000000;
  o.snapshot = SnapshotMode::kBorrow;
  o.on_busy = OnBusy::kSkip;
  o.max_in_flight = 3;
  o.keep = 0;
  o.keep_every = 1000;
  o.prefix = "step_\"q\"";
  o.overwrite = true;
  o.threads = 12;
  o.io = {.block_size = 8 * kMiB, .queue_depth = 32, .direct = Options::Io::Direct::kOff,
          .register_buffers = false, .recycle = false};
  o.trace.path = "/tmp/trace.json";
  o.gcs.endpoint = "http://localhost:4443";
  o.gcs.chunk_size = 32 * kMiB;
  o.gcs.connections = 64;
  o.gcs.retry = {.max_attempts = 2, .initial_backoff = 1500ms, .max_backoff = 90s,
                 .deadline = 1h};
  o.gcs.timeouts = {.connect = 3s, .stall = 45s};
  o.gcs.headers = {{"X-Custom", "v"}};
  o.gcs.user_project = "billing";
  o.gcs.http_version = "2";
  o.gcs.allow_http_credentials = true;
  o.preemption = {.on_sigterm = true, .grace = 1min};
  const std::string text = ToJson(o);
  CHECK(nlohmann::json::accept(text));  // no comments: any JSON tool can read the dump
  CHECK(Parse(text) == o);
}

TEST_CASE("ToJson redacts the value of an Authorization header") {
  Options o;
  o.gcs.headers = {{"Authorization", "Bearer ya29.secret"}, {"X-Trace", "on"}};
  const std::string text = ToJson(o);
  CHECK_FALSE(Contains(text, "ya29.secret"));
  const auto headers = nlohmann::json::parse(text)["gcs"]["headers"];
  CHECK(headers["Authorization"] == "<redacted>");
  CHECK(headers["X-Trace"] == "on");
}

TEST_CASE("ToJson redacts a header value that looks like a credential, whatever the header is called") {
  Options o;
  o.gcs.headers = {{"X-Upstream", "Bearer ya29.a0AfB-upstream"},
                   {"X-Forward", "basic dXNlcjpwYXNzd29yZA=="},
                   {"X-Passthrough", "ya29.c.passthrough"},
                   {"X-Opaque", "3kq9Zr8LmQ2vXy7TbNw4GOCSPX12"},
                   {"X-Goog-User-Project", "my-billing-project"},
                   {"X-Trace", "on"}};
  const auto headers = nlohmann::json::parse(ToJson(o))["gcs"]["headers"];
  CHECK(headers["X-Upstream"] == "<redacted>");
  CHECK(headers["X-Forward"] == "<redacted>");
  CHECK(headers["X-Passthrough"] == "<redacted>");
  CHECK(headers["X-Opaque"] == "<redacted>");
  CHECK(headers["X-Goog-User-Project"] == "my-billing-project");
  CHECK(headers["X-Trace"] == "on");
}

TEST_CASE("ToJson redacts credentials in the endpoint URL") {
  Options o;
  o.gcs.endpoint = "https://user:hunter2@proxy.example:8443/storage";
  const std::string text = ToJson(o);
  CHECK(nlohmann::json::parse(text)["gcs"]["endpoint"] ==
        "https://<redacted>@proxy.example:8443/storage");
}

TEST_CASE("secret-looking header names are recognised") {
  CHECK(IsSecretHeader("Authorization"));
  CHECK(IsSecretHeader("proxy-authorization"));
  CHECK(IsSecretHeader("X-Goog-Api-Key"));
  CHECK(IsSecretHeader("Cookie"));
  CHECK_FALSE(IsSecretHeader("X-Goog-User-Project"));
}

// ---- The table itself ----

TEST_CASE("every knob's group is listed before it, with the group's knobs contiguous") {
  std::vector<std::string_view> open;  // the groups enclosing the current row
  std::set<std::string_view> closed;
  for (const Knob& knob : Knobs()) {
    CAPTURE(knob.path);
    const size_t dot = knob.path.rfind('.');
    const std::string_view parent = dot == std::string_view::npos ? "" : knob.path.substr(0, dot);
    while (!open.empty() && open.back() != parent) {
      closed.insert(open.back());
      open.pop_back();
    }
    CHECK((parent.empty() || (!open.empty() && open.back() == parent)));
    CHECK(closed.count(knob.path) == 0);
    CHECK(FindKnob(knob.path) == &knob);
    CHECK_FALSE(knob.description.empty());
    if (knob.is_group()) open.push_back(knob.path);
  }
}

}  // namespace
}  // namespace ckptio::config
