#pragma once
// Rounding sizes and offsets to an alignment (O_DIRECT blocks, staging slots, pages).

#include <cstdint>

namespace ckptio::base {

// n rounded up to a multiple of a (a > 0; n + a must not overflow).
constexpr uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }
// n rounded down to a multiple of a (a > 0).
constexpr uint64_t RoundDown(uint64_t n, uint64_t a) { return n / a * a; }

}  // namespace ckptio::base
