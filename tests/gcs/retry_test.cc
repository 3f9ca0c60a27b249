// The retry back-off on its own: capped exponential bounds, full jitter,
// max_attempts and the deadline. A clock the test moves and fixed seeds make
// every case deterministic: nothing here sleeps or reads the time.

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "gcs/pacer.h"
#include "gcs/retry.h"

namespace ckptio::gcs {
namespace {

using std::chrono::milliseconds;
using TimePoint = std::chrono::steady_clock::time_point;

constexpr int kSeeds = 500;

Options::Gcs::Retry Policy(int max_attempts, milliseconds initial, milliseconds max, milliseconds deadline) {
  Options::Gcs::Retry p;
  p.max_attempts = max_attempts;
  p.initial_backoff = initial;
  p.max_backoff = max;
  p.deadline = deadline;
  return p;
}

// A clock that stands still until the test moves it.
struct TestClock {
  TimePoint now{std::chrono::hours(1)};
  Now fn() {
    return [this] { return now; };
  }
};

// The delay before retry `retry` (1 = the first retry) of a fresh Backoff
// seeded with `seed`, its clock standing still.
milliseconds DelayBefore(const Options::Gcs::Retry& policy, int retry, uint64_t seed) {
  TestClock clock;
  Backoff b(policy, clock.fn(), seed);
  milliseconds delay{-1};
  for (int i = 0; i < retry; ++i) REQUIRE(b.Next(&delay));
  return delay;
}

// The smallest and largest delay before retry `retry` over kSeeds seeds.
std::pair<milliseconds, milliseconds> DelayRange(const Options::Gcs::Retry& policy, int retry) {
  milliseconds lo = milliseconds::max(), hi = milliseconds::min();
  for (uint64_t seed = 0; seed < kSeeds; ++seed) {
    milliseconds d = DelayBefore(policy, retry, seed);
    lo = std::min(lo, d);
    hi = std::max(hi, d);
  }
  return {lo, hi};
}

TEST_CASE("each retry waits a full-jitter delay under a bound that doubles from initial_backoff to max_backoff") {
  const auto policy = Policy(10, milliseconds(100), milliseconds(1000), std::chrono::hours(1));
  // Bounds 100, 200, 400, 800, then capped at 1000.
  const std::vector<int64_t> bound = {100, 200, 400, 800, 1000, 1000, 1000};
  for (int retry = 1; retry <= static_cast<int>(bound.size()); ++retry) {
    CAPTURE(retry);
    auto [lo, hi] = DelayRange(policy, retry);
    const int64_t b = bound[retry - 1];
    CHECK(lo.count() >= 0);
    CHECK(hi.count() < b);  // never at or past the bound
    // Full jitter: the delays spread over the whole range, from near 0 to
    // near the bound (with 500 seeds, a fixed set: the same every run).
    CHECK(lo.count() < b / 20);
    CHECK(hi.count() >= b - b / 20);
  }
}

TEST_CASE("the same seed gives the same delays and different seeds different ones") {
  const auto policy = Policy(10, milliseconds(1000), milliseconds(60000), std::chrono::hours(1));
  CHECK(DelayBefore(policy, 5, 42) == DelayBefore(policy, 5, 42));
  std::vector<int64_t> seen;
  for (uint64_t seed = 0; seed < 20; ++seed) seen.push_back(DelayBefore(policy, 5, seed).count());
  std::sort(seen.begin(), seen.end());
  CHECK(std::unique(seen.begin(), seen.end()) - seen.begin() > 15);
}

TEST_CASE("a long series of retries stays under max_backoff") {
  // 2^(attempt-1) would overflow long before attempt 200; the bound must not.
  const auto policy = Policy(200, milliseconds(1), milliseconds(5000), std::chrono::hours(24 * 365));
  TestClock clock;
  Backoff b(policy, clock.fn(), 7);
  milliseconds delay;
  int64_t largest = 0;
  for (int retry = 1; retry < 200; ++retry) {
    REQUIRE(b.Next(&delay));
    CHECK(delay.count() >= 0);
    CHECK(delay.count() < 5000);
    largest = std::max<int64_t>(largest, delay.count());
  }
  CHECK(largest > 2500);  // the bound did reach max_backoff
  CHECK(b.attempts() == 200);
}

TEST_CASE("there are max_attempts attempts in all, the first one included") {
  const auto policy = Policy(3, milliseconds(10), milliseconds(100), std::chrono::hours(1));
  TestClock clock;
  Backoff b(policy, clock.fn(), 1);
  milliseconds delay;
  CHECK(b.attempts() == 1);
  CHECK(b.Next(&delay));
  CHECK(b.Next(&delay));
  CHECK(b.attempts() == 3);
  CHECK_FALSE(b.Next(&delay));
  CHECK(b.attempts() == 3);
}

TEST_CASE("max_attempts 1 means no retry at all") {
  TestClock clock;
  Backoff b(Policy(1, milliseconds(10), milliseconds(100), std::chrono::hours(1)), clock.fn(), 1);
  milliseconds delay;
  CHECK_FALSE(b.Next(&delay));
}

TEST_CASE("a retry is refused exactly when its delay would end at or past the deadline") {
  const auto policy = Policy(100, milliseconds(100), milliseconds(100), milliseconds(1000));
  for (uint64_t seed = 0; seed < 50; ++seed) {
    CAPTURE(seed);
    // The delay this seed draws first, with no time gone.
    const milliseconds delay = DelayBefore(policy, 1, seed);
    const int64_t last_allowed = 999 - delay.count();  // ends 1 ms before the deadline
    for (int64_t elapsed : {int64_t{0}, last_allowed, last_allowed + 1, int64_t{1000}, int64_t{5000}}) {
      CAPTURE(elapsed);
      TestClock clock;
      Backoff b(policy, clock.fn(), seed);
      clock.now += milliseconds(elapsed);
      milliseconds got;
      const bool allowed = b.Next(&got);
      CHECK(allowed == (elapsed + delay.count() < 1000));
      if (allowed) CHECK(got == delay);  // the clock does not change the draw
    }
  }
}

TEST_CASE("the deadline counts from the Backoff's creation") {
  const auto policy = Policy(100, milliseconds(10), milliseconds(10), milliseconds(1000));
  TestClock clock;
  clock.now += std::chrono::hours(5);  // whatever the clock said before does not count
  Backoff b(policy, clock.fn(), 3);
  milliseconds delay;
  CHECK(b.Next(&delay));
  CHECK(b.deadline() == clock.now + milliseconds(1000));
  clock.now += milliseconds(1000);
  CHECK_FALSE(b.Next(&delay));
}

TEST_CASE("when attempts run out, the message names gcs.retry.max_attempts, the attempts and the time") {
  TestClock clock;
  Backoff b(Policy(2, milliseconds(10), milliseconds(10), milliseconds(30000)), clock.fn(), 1);
  milliseconds delay;
  REQUIRE(b.Next(&delay));
  clock.now += milliseconds(1234);
  REQUIRE_FALSE(b.Next(&delay));
  CHECK(b.Exhausted() ==
        "gave up after 2 attempts in 1234 ms: gcs.retry.max_attempts 2 reached (gcs.retry.deadline 30000 ms)");
}

TEST_CASE("when the deadline runs out, the message names gcs.retry.deadline") {
  TestClock clock;
  Backoff b(Policy(6, milliseconds(10), milliseconds(10), milliseconds(2000)), clock.fn(), 1);
  clock.now += milliseconds(2000);
  milliseconds delay;
  REQUIRE_FALSE(b.Next(&delay));
  CHECK(b.Exhausted() ==
        "gave up after 1 attempt in 2000 ms: gcs.retry.deadline 2000 ms reached (gcs.retry.max_attempts 6)");
}

TEST_CASE("the upload pacer spaces requests so that the bytes never go faster than the rate") {
  using std::chrono::seconds;
  UploadPacer pacer(1'000'000);  // 1 MB/s
  const UploadPacer::Clock::time_point t0{seconds(100)};
  CHECK(pacer.Reserve(t0, 1'000'000) == seconds(0));           // the link is free: go
  CHECK(pacer.Reserve(t0, 500'000) == seconds(1));             // after the first megabyte
  CHECK(pacer.Reserve(t0 + milliseconds(500), 250'000) == seconds(1));  // after 1.5 MB: t0 + 1.5 s
  // Idle time is not saved up for a burst later: after a pause the next
  // request goes at once, the one after it waits for it.
  CHECK(pacer.Reserve(t0 + seconds(10), 2'000'000) == seconds(0));
  CHECK(pacer.Reserve(t0 + seconds(10), 1) == seconds(2));
}

}  // namespace
}  // namespace ckptio::gcs
