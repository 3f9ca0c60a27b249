// CRC32C against published vectors, and Extend/Combine against direct CRCs.

#include <doctest/doctest.h>
#include <sys/mman.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "format/crc32c.h"

namespace ckptio::format {
namespace {

uint32_t Crc(const std::string& s) { return Crc32c(s.data(), s.size()); }

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST_CASE("crc32c matches the standard check value and the RFC 3720 vectors") {
  CHECK(Crc("123456789") == 0xE3069283u);
  CHECK(Crc("") == 0u);
  CHECK(Crc(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(Crc(std::string(32, '\xff')) == 0x62A8AB43u);
  std::string ascending(32, '\0'), descending(32, '\0');
  for (int i = 0; i < 32; ++i) {
    ascending[static_cast<size_t>(i)] = static_cast<char>(i);
    descending[static_cast<size_t>(i)] = static_cast<char>(31 - i);
  }
  CHECK(Crc(ascending) == 0x46DD794Eu);
  CHECK(Crc(descending) == 0x113FDB5Cu);
}

TEST_CASE("extending from zero is the plain crc") {
  const std::string s = "The quick brown fox jumps over the lazy dog";
  CHECK(Crc32cExtend(0, s.data(), s.size()) == Crc(s));
  CHECK(Crc(s) == 0x22620404u);
}

TEST_CASE("extending a crc over random splits equals the crc of the whole") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const std::string data = RandomBytes(rng, rng() % 5000);
    const size_t split = data.empty() ? 0 : rng() % (data.size() + 1);
    const uint32_t head = Crc32c(data.data(), split);
    CHECK(Crc32cExtend(head, data.data() + split, data.size() - split) == Crc(data));
  }
}

TEST_CASE("combining crcs over random splits equals the crc of the whole") {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 200; ++round) {
    const std::string data = RandomBytes(rng, rng() % 5000);
    const size_t split = data.empty() ? 0 : rng() % (data.size() + 1);
    const uint32_t a = Crc32c(data.data(), split);
    const uint32_t b = Crc32c(data.data() + split, data.size() - split);
    CHECK(Crc32cCombine(a, b, data.size() - split) == Crc(data));
  }
}

TEST_CASE("combining with an empty piece keeps the other crc") {
  CHECK(Crc32cCombine(0xE3069283u, 0, 0) == 0xE3069283u);
  CHECK(Crc32cCombine(0, 0xE3069283u, 9) == 0xE3069283u);
}

TEST_CASE("crcs of many chunks combine in order to the crc of the whole") {
  std::mt19937_64 rng(13);
  const std::string data = RandomBytes(rng, 1 << 20);
  const size_t chunk = 65536 + 17;  // uneven, so the last chunk is short
  uint32_t combined = 0;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t len = std::min(chunk, data.size() - off);
    combined = Crc32cCombine(combined, Crc32c(data.data() + off, len), len);
  }
  CHECK(combined == Crc(data));
}

TEST_CASE("combining is associative for lengths far beyond memory") {
  // Without the data, check (a+b)+c == a+(b+c) on terabyte-scale pieces.
  const uint32_t a = 0x12345678, b = 0x9ABCDEF0, c = 0x0F1E2D3C;
  const uint64_t len_b = (uint64_t{1} << 40) + 3, len_c = (uint64_t{1} << 35) + 12345;
  const uint32_t left = Crc32cCombine(Crc32cCombine(a, b, len_b), c, len_c);
  const uint32_t right = Crc32cCombine(a, Crc32cCombine(b, c, len_c), len_b + len_c);
  CHECK(left == right);
}

TEST_CASE("a buffer over 1 GiB is checksummed in pieces ISA-L accepts") {
  // Untouched anonymous pages read as zeros without costing memory.
  const size_t n = (size_t{1} << 30) + 4099;
  void* zeros = mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(zeros != MAP_FAILED);
  const size_t head = 12345;
  const uint32_t expected = Crc32cCombine(Crc32c(zeros, head),
                                          Crc32c(static_cast<char*>(zeros) + head, n - head),
                                          n - head);
  CHECK(Crc32c(zeros, n) == expected);
  munmap(zeros, n);
}

TEST_CASE("base64 spells the big-endian crc the way GCS does") {
  CHECK(Crc32cToBase64(0xE3069283u) == "4waSgw==");
  CHECK(Crc32cToBase64(0) == "AAAAAA==");
  CHECK(Crc32cToBase64(0xFFFFFFFFu) == "/////w==");
}

TEST_CASE("base64 crcs round-trip") {
  std::mt19937 rng(5);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t crc = static_cast<uint32_t>(rng());
    auto back = Crc32cFromBase64(Crc32cToBase64(crc));
    REQUIRE(back.ok());
    CHECK(*back == crc);
  }
}

TEST_CASE("malformed base64 crcs are rejected with the text quoted") {
  for (std::string_view bad : {"", "4waSgw=", "4waSgw===", "4waSg===", "4wa*gw==", "4waSgx==",
                               "4waSgwAA"}) {
    auto crc = Crc32cFromBase64(bad);
    REQUIRE_FALSE(crc.ok());
    CHECK(crc.status().message() ==
          "CRC32C \"" + std::string(bad) + "\" is not 8 characters of base64");
  }
}

TEST_CASE("hex crcs round-trip and accept either case") {
  CHECK(Crc32cToHex(0xE3069283u) == "e3069283");
  CHECK(Crc32cToHex(0x1u) == "00000001");
  CHECK(*Crc32cFromHex("e3069283") == 0xE3069283u);
  CHECK(*Crc32cFromHex("E3069283") == 0xE3069283u);
}

TEST_CASE("malformed hex crcs are rejected") {
  for (std::string_view bad : {"", "e306928", "e30692830", "e306928g", "0xe30692", "-3069283"}) {
    auto crc = Crc32cFromHex(bad);
    REQUIRE_FALSE(crc.ok());
    CHECK(crc.status().message() == "CRC32C \"" + std::string(bad) + "\" is not 8 hex digits");
  }
}

}  // namespace
}  // namespace ckptio::format
