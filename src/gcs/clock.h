#pragma once

#include <chrono>
#include <functional>

namespace ckptio::gcs {

// The steady clock as a value: std::chrono::steady_clock::now, or a clock a
// test moves itself (the token cache's refresh time, the retry deadline).
using Now = std::function<std::chrono::steady_clock::time_point()>;

}  // namespace ckptio::gcs
