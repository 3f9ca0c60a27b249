#include "config/units.h"

#include <array>
#include <cctype>
#include <cstdio>
#include <limits>

#include "base/text.h"

namespace ckptio::config {
namespace {

// 128-bit intermediates make "value * unit" and "fraction * unit / 10^n"
// exact without a maze of overflow checks; results are range-checked after.
__extension__ typedef unsigned __int128 U128;

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
// More fraction digits than this cannot change a nanosecond or a byte count
// in any unit we accept, and keeps 10^n inside 64 bits.
constexpr int kMaxFractionDigits = 18;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

void SkipSpaces(std::string_view& s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

// A non-negative decimal number "123", "1.5", ".5": whole part and fraction
// digits, kept as integers so that no precision is lost.
struct Decimal {
  U128 whole = 0;  // saturates far above any valid result, which then reads as "too large"
  uint64_t fraction = 0;  // the digits after the point, as an integer
  int fraction_digits = 0;
  bool too_precise = false;  // a nonzero digit beyond kMaxFractionDigits
};

U128 Pow10(int n) {
  U128 p = 1;
  for (int i = 0; i < n; ++i) p *= 10;
  return p;
}

// Consumes a decimal number from the front of `s`. Returns false if `s` does
// not start with one.
bool ConsumeDecimal(std::string_view& s, Decimal& out) {
  constexpr U128 kSaturated = static_cast<U128>(1) << 70;
  size_t i = 0;
  bool any_digit = false;
  out = {};
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) {
    if (out.whole < kSaturated) out.whole = out.whole * 10 + static_cast<unsigned>(s[i] - '0');
    any_digit = true;
  }
  if (i < s.size() && s[i] == '.') {
    ++i;
    for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) {
      any_digit = true;
      if (out.fraction_digits == kMaxFractionDigits) {
        if (s[i] != '0') out.too_precise = true;
        continue;
      }
      out.fraction = out.fraction * 10 + static_cast<uint64_t>(s[i] - '0');
      ++out.fraction_digits;
    }
  }
  if (!any_digit) return false;
  s.remove_prefix(i);
  return true;
}

// value * unit, exact; false if the fraction leaves a remainder below 1.
// (whole < 2^71 and unit < 2^62, so the product fits in 128 bits.)
bool Scale(const Decimal& d, uint64_t unit, U128& out) {
  if (d.too_precise) return false;
  U128 frac = static_cast<U128>(d.fraction) * unit;
  U128 div = Pow10(d.fraction_digits);
  if (frac % div != 0) return false;
  out = d.whole * unit + frac / div;
  return true;
}

struct Unit {
  std::string_view name;
  uint64_t factor;
};

constexpr std::array<Unit, 11> kSizeUnits = {{
    {"B", 1},
    {"KiB", uint64_t{1} << 10}, {"MiB", uint64_t{1} << 20}, {"GiB", uint64_t{1} << 30},
    {"TiB", uint64_t{1} << 40}, {"PiB", uint64_t{1} << 50},
    {"KB", 1000}, {"MB", 1000 * 1000}, {"GB", 1000 * 1000 * 1000},
    {"TB", uint64_t{1000} * 1000 * 1000 * 1000}, {"PB", uint64_t{1000} * 1000 * 1000 * 1000 * 1000},
}};

constexpr uint64_t kNs = 1;
constexpr uint64_t kUs = 1000 * kNs;
constexpr uint64_t kMs = 1000 * kUs;
constexpr uint64_t kSec = 1000 * kMs;
constexpr uint64_t kMin = 60 * kSec;
constexpr uint64_t kHour = 60 * kMin;

// Longest names first so that "ms" is not read as "m" followed by junk.
constexpr std::array<Unit, 7> kDurationUnits = {{
    {"ns", kNs}, {"us", kUs}, {"\xC2\xB5s", kUs} /* µs */, {"ms", kMs},
    {"s", kSec}, {"m", kMin}, {"h", kHour},
}};

Status SizeError(std::string_view text, std::string_view why) {
  return InvalidArgumentError("invalid size " + base::Quoted(text) + ": " + std::string(why));
}

Status DurationError(std::string_view text, std::string_view why) {
  return InvalidArgumentError("invalid duration " + base::Quoted(text) + ": " + std::string(why));
}

// The unit name at the front of `s`: letters, or the two bytes of "µ".
std::string_view ConsumeUnitName(std::string_view& s) {
  size_t i = 0;
  while (i < s.size() && (std::isalpha(static_cast<unsigned char>(s[i])) ||
                          static_cast<unsigned char>(s[i]) >= 0x80)) {
    ++i;
  }
  std::string_view name = s.substr(0, i);
  s.remove_prefix(i);
  return name;
}

}  // namespace

Result<uint64_t> ParseSize(std::string_view text) {
  std::string_view s = Trim(text);
  if (s.empty()) return SizeError(text, "empty; expected e.g. \"256MiB\" or a number of bytes");
  if (s.front() == '-') return SizeError(text, "must not be negative");
  Decimal number;
  if (!ConsumeDecimal(s, number)) {
    return SizeError(text, "expected a number of bytes, optionally followed by a unit "
                           "such as KiB, MiB, GiB, KB, MB, GB");
  }
  SkipSpaces(s);
  uint64_t factor = 0;
  if (s.empty()) {
    factor = 1;
  } else {
    for (const Unit& u : kSizeUnits) {
      if (EqualsIgnoreCase(s, u.name)) factor = u.factor;
    }
    if (factor == 0) {
      const bool bare_prefix = s.size() == 1 && std::string_view("kmgtpKMGTP").find(s[0]) !=
                                                    std::string_view::npos;
      if (bare_prefix) {
        const char up = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
        return SizeError(text, "ambiguous unit " + base::Quoted(s) + ": write " + up + "iB (1024-based) or " +
                                   up + "B (1000-based)");
      }
      return SizeError(text, "unknown unit " + base::Quoted(s) +
                                 " (expected B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB or PB)");
    }
  }
  U128 bytes = 0;
  if (!Scale(number, factor, bytes)) return SizeError(text, "not a whole number of bytes");
  if (bytes > kMaxU64) return SizeError(text, "too large (at most 2^64-1 bytes)");
  return static_cast<uint64_t>(bytes);
}

std::string FormatSize(uint64_t bytes) {
  if (bytes == 0) return "0B";
  // The exact unit with the smallest number in front: 16000000 is "16MB",
  // not "15625KiB"; 4096 is "4KiB". (No tie is possible: 1024^n != 1000^m.)
  const Unit* best = &kSizeUnits[0];
  for (const Unit& u : kSizeUnits) {
    if (bytes % u.factor == 0 && bytes / u.factor < bytes / best->factor) best = &u;
  }
  return std::to_string(bytes / best->factor) + std::string(best->name);
}

std::string FormatSizeApprox(uint64_t bytes) {
  size_t unit = 0;
  for (size_t i = 1; i <= 5; ++i) {
    if (bytes >= kSizeUnits[i].factor) unit = i;
  }
  if (unit == 0) return std::to_string(bytes) + "B";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f%s",
                static_cast<double>(bytes) / static_cast<double>(kSizeUnits[unit].factor),
                std::string(kSizeUnits[unit].name).c_str());
  return buf;
}

Result<std::chrono::nanoseconds> ParseDuration(std::string_view text) {
  std::string_view s = Trim(text);
  if (s.empty()) return DurationError(text, "empty; expected e.g. \"30s\", \"100ms\" or seconds");
  if (s.front() == '-') return DurationError(text, "must not be negative");
  U128 total = 0;
  bool first = true;
  while (!s.empty()) {
    Decimal number;
    if (!ConsumeDecimal(s, number)) {
      return DurationError(text, "expected a number followed by a unit (h, m, s, ms, us, ns)");
    }
    SkipSpaces(s);
    std::string_view unit_name = ConsumeUnitName(s);
    uint64_t factor = 0;
    if (unit_name.empty()) {
      // A bare number means seconds, as a JSON number does; only on its own,
      // since "1m30" is more likely a typo than 1 minute 30 seconds.
      if (!first || !s.empty()) {
        return DurationError(text, "every number needs a unit (h, m, s, ms, us, ns)");
      }
      factor = kSec;
    } else {
      for (const Unit& u : kDurationUnits) {
        if (unit_name == u.name) factor = u.factor;
      }
      if (factor == 0) {
        return DurationError(text, "unknown unit " + base::Quoted(unit_name) +
                                       " (expected h, m, s, ms, us or ns)");
      }
    }
    U128 part = 0;
    if (!Scale(number, factor, part)) return DurationError(text, "finer than a nanosecond");
    total += part;
    if (total > static_cast<U128>(std::numeric_limits<int64_t>::max())) {
      return DurationError(text, "too long (at most about 292 years)");
    }
    SkipSpaces(s);
    first = false;
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(total));
}

std::string FormatDuration(std::chrono::nanoseconds d) {
  const int64_t ns = d.count();
  if (ns == 0) return "0s";
  const std::string sign = ns < 0 ? "-" : "";
  const uint64_t magnitude = ns < 0 ? uint64_t{0} - static_cast<uint64_t>(ns)
                                    : static_cast<uint64_t>(ns);
  constexpr std::array<Unit, 6> kLargestFirst = {{
      {"h", kHour}, {"m", kMin}, {"s", kSec}, {"ms", kMs}, {"us", kUs}, {"ns", kNs},
  }};
  for (const Unit& u : kLargestFirst) {
    if (magnitude % u.factor == 0) {
      return sign + std::to_string(magnitude / u.factor) + std::string(u.name);
    }
  }
  return sign + std::to_string(magnitude) + "ns";  // unreachable: ns divides everything
}

}  // namespace ckptio::config
