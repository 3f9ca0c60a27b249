#pragma once
// Sizes ("256MiB") and durations ("30s") as people write them, for the config
// file and the CLI. Pure functions; any thread.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "ckptio/status.h"

namespace ckptio::config {

// Parses a byte count: "512", "512B", "4KiB", "256 MiB", "1.5GiB", "16MB".
// KiB/MiB/GiB/TiB/PiB are 1024-based, KB/MB/GB/TB/PB 1000-based; units are
// case-insensitive. Bare "K"/"M"/"G" are refused as ambiguous. A fraction is
// allowed when the result is a whole number of bytes. Errors are
// InvalidArgument: `invalid size "12XB": unknown unit "XB" ...`.
Result<uint64_t> ParseSize(std::string_view text);

// The exact, shortest form that ParseSize reads back to the same value:
// 268435456 -> "256MiB", 16000000 -> "16MB", 1000 -> "1KB", 1234 -> "1234B".
std::string FormatSize(uint64_t bytes);

// For display only, rounded to one decimal: 1288490188 -> "1.2GiB".
std::string FormatSizeApprox(uint64_t bytes);

// Parses a duration: "30s", "100ms", "2m", "1h", "250us", "10ns", "1.5s",
// Go-style sums such as "1h30m", or a bare number of seconds ("30", "0.25").
// Must be >= 0, a whole number of nanoseconds, and fit in int64 nanoseconds.
Result<std::chrono::nanoseconds> ParseDuration(std::string_view text);

// The exact form in the largest unit that divides it: 30000ms -> "30s",
// 90s -> "90s", 200ms -> "200ms", 0 -> "0s". ParseDuration reads it back.
std::string FormatDuration(std::chrono::nanoseconds d);

}  // namespace ckptio::config
