// Sizes and durations as people write them: the parsers the config file and
// the CLI share.

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "config/units.h"

namespace ckptio::config {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

uint64_t Size(std::string_view text) {
  auto r = ParseSize(text);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  return *r;
}

std::string SizeError(std::string_view text) {
  auto r = ParseSize(text);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

std::chrono::nanoseconds Duration(std::string_view text) {
  auto r = ParseDuration(text);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  return *r;
}

std::string DurationError(std::string_view text) {
  auto r = ParseDuration(text);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

TEST_CASE("a size without a unit is a number of bytes") {
  CHECK(Size("512") == 512);
  CHECK(Size("512B") == 512);
  CHECK(Size("0") == 0);
}

TEST_CASE("KiB, MiB, GiB and TiB are 1024-based") {
  CHECK(Size("4KiB") == 4 * kKiB);
  CHECK(Size("256MiB") == 256 * kMiB);
  CHECK(Size("1GiB") == kGiB);
  CHECK(Size("2TiB") == 2 * 1024 * kGiB);
}

TEST_CASE("KB, MB, GB and TB are 1000-based") {
  CHECK(Size("4KB") == 4000);
  CHECK(Size("16MB") == 16000000);
  CHECK(Size("1GB") == 1000000000);
  CHECK(Size("3TB") == 3000000000000);
}

TEST_CASE("size units are case-insensitive and may follow a space") {
  CHECK(Size("256 MiB") == 256 * kMiB);
  CHECK(Size("4kib") == 4 * kKiB);
  CHECK(Size("  1 gb ") == 1000000000);
}

TEST_CASE("a fractional size is accepted when it is a whole number of bytes") {
  CHECK(Size("1.5GiB") == kGiB + kGiB / 2);
  CHECK(Size("0.5KiB") == 512);
  CHECK(SizeError("0.3KiB") == "invalid size \"0.3KiB\": not a whole number of bytes");
}

TEST_CASE("a bare K, M or G is refused as ambiguous") {
  CHECK(SizeError("16M") ==
        "invalid size \"16M\": ambiguous unit \"M\": write MiB (1024-based) or MB (1000-based)");
}

TEST_CASE("an unknown size unit is named in the error") {
  CHECK(SizeError("12XB") ==
        "invalid size \"12XB\": unknown unit \"XB\" (expected B, KiB, MiB, GiB, TiB, PiB, KB, "
        "MB, GB, TB or PB)");
}

TEST_CASE("a negative, empty or non-numeric size is refused") {
  CHECK(SizeError("-1MiB") == "invalid size \"-1MiB\": must not be negative");
  CHECK(SizeError("").find("empty") != std::string::npos);
  CHECK(SizeError("MiB").find("expected a number of bytes") != std::string::npos);
}

TEST_CASE("a size beyond 2^64-1 bytes is refused, not wrapped") {
  CHECK(Size("18446744073709551615") == UINT64_MAX);
  CHECK(SizeError("18446744073709551616").find("too large") != std::string::npos);
  CHECK(SizeError("16777216TiB").find("too large") != std::string::npos);
  CHECK(SizeError("99999999999999999999999999999PiB").find("too large") != std::string::npos);
}

TEST_CASE("FormatSize picks the largest unit that is exact") {
  CHECK(FormatSize(256 * kMiB) == "256MiB");
  CHECK(FormatSize(2 * kGiB) == "2GiB");
  CHECK(FormatSize(4096) == "4KiB");
  CHECK(FormatSize(16000000) == "16MB");
  CHECK(FormatSize(1000) == "1KB");
  CHECK(FormatSize(1234) == "1234B");
  CHECK(FormatSize(0) == "0B");
  CHECK(FormatSize(1536 * kMiB) == "1536MiB");
}

TEST_CASE("FormatSize output parses back to the same number of bytes") {
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{999}, uint64_t{4096}, 3 * kGiB + 5,
                     uint64_t{16000000}, UINT64_MAX, uint64_t{1} << 62}) {
    CAPTURE(n);
    CHECK(Size(FormatSize(n)) == n);
  }
}

TEST_CASE("FormatSizeApprox rounds to one decimal in a binary unit") {
  CHECK(FormatSizeApprox(1288490188) == "1.2GiB");
  CHECK(FormatSizeApprox(512) == "512B");
  CHECK(FormatSizeApprox(1536) == "1.5KiB");
}

TEST_CASE("durations take h, m, s, ms, us and ns units") {
  CHECK(Duration("30s") == 30s);
  CHECK(Duration("100ms") == 100ms);
  CHECK(Duration("2m") == 2min);
  CHECK(Duration("1h") == 1h);
  CHECK(Duration("250us") == 250us);
  CHECK(Duration("250\xC2\xB5s") == 250us);
  CHECK(Duration("10ns") == 10ns);
}

TEST_CASE("a duration may be fractional or a sum of parts") {
  CHECK(Duration("1.5s") == 1500ms);
  CHECK(Duration("1h30m") == 90min);
  CHECK(Duration("1m 30s") == 90s);
  CHECK(Duration("0.5 ms") == 500us);
}

TEST_CASE("a duration without a unit is a number of seconds") {
  CHECK(Duration("30") == 30s);
  CHECK(Duration("0.25") == 250ms);
}

TEST_CASE("malformed durations are refused with the reason") {
  CHECK(DurationError("30x") ==
        "invalid duration \"30x\": unknown unit \"x\" (expected h, m, s, ms, us or ns)");
  CHECK(DurationError("-1s") == "invalid duration \"-1s\": must not be negative");
  CHECK(DurationError("1m30").find("every number needs a unit") != std::string::npos);
  CHECK(DurationError("s").find("expected a number") != std::string::npos);
  CHECK(DurationError("").find("empty") != std::string::npos);
  CHECK(DurationError("1.5ns").find("finer than a nanosecond") != std::string::npos);
  CHECK(DurationError("300y").find("unknown unit \"y\"") != std::string::npos);
  CHECK(DurationError("100000000h").find("too long") != std::string::npos);
}

TEST_CASE("FormatDuration picks the largest unit that is exact") {
  CHECK(FormatDuration(30s) == "30s");
  CHECK(FormatDuration(300000ms) == "5m");
  CHECK(FormatDuration(90s) == "90s");
  CHECK(FormatDuration(200ms) == "200ms");
  CHECK(FormatDuration(2h) == "2h");
  CHECK(FormatDuration(1500us) == "1500us");
  CHECK(FormatDuration(0s) == "0s");
}

TEST_CASE("FormatDuration output parses back to the same duration") {
  for (std::chrono::nanoseconds d : {std::chrono::nanoseconds(1), std::chrono::nanoseconds(90s),
                                     std::chrono::nanoseconds(3723001ms),
                                     std::chrono::nanoseconds(INT64_MAX)}) {
    CAPTURE(d.count());
    CHECK(Duration(FormatDuration(d)) == d);
  }
}

}  // namespace
}  // namespace ckptio::config
