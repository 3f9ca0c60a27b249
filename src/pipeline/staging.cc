#include "pipeline/staging.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/align.h"

namespace ckptio::pipeline {
namespace {
constexpr uint64_t kPrefaultChunk = uint64_t{64} << 20;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
using base::RoundUp;
}  // namespace

Result<std::unique_ptr<StagingPool>> StagingPool::Create(uint64_t limit, uint64_t resident, GrownFn on_grown,
                                                         bool held) {
  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->holds_ = held ? 1 : 0;
  pool->on_grown_ = std::move(on_grown);
  // Whole pages, and never more than the limit (staging_memory is a bound).
  pool->capacity_ = std::max<uint64_t>(limit / kAlign * kAlign, kAlign);
  // Address space only: MAP_NORESERVE, and no page is touched here.
  void* p = ::mmap(nullptr, pool->capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno, "cannot reserve " + std::to_string(pool->capacity_) +
                                    " bytes of address space for staging memory (staging_memory)");
  }
  pool->base_ = static_cast<char*>(p);
  (void)::madvise(pool->base_, pool->capacity_, MADV_NOHUGEPAGE);  // see the header
  pool->free_[0] = pool->capacity_;
  pool->free_bytes_ = pool->capacity_;
  {
    std::lock_guard lock(pool->mu_);
    pool->WantResident(resident);
  }
  StagingPool* raw = pool.get();
  pool->prefault_ = std::thread([raw] { raw->PrefaultLoop(); });
  return pool;
}

StagingPool::~StagingPool() {
  StopPrefault();
  if (base_ != nullptr) ::munmap(base_, capacity_);
}

void StagingPool::StopPrefault() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (prefault_.joinable()) prefault_.join();
}

void StagingPool::HoldPrefault() {
  std::lock_guard lock(mu_);
  ++holds_;
}

void StagingPool::ReleasePrefault() {
  {
    std::lock_guard lock(mu_);
    --holds_;
  }
  cv_.notify_all();
}

void StagingPool::WantResident(uint64_t end) {
  end = std::min(RoundUp(end, kGrowStep), capacity_);
  if (end <= target_) return;
  target_ = end;
  cv_.notify_all();
}

void StagingPool::PrefaultLoop() {
  pthread_setname_np(pthread_self(), "ckptio-prefault");
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || (resident_ < target_ && holds_ == 0); });
    if (stop_) break;
    const uint64_t off = resident_;
    const uint64_t n = std::min(kPrefaultChunk, target_ - off);
    lock.unlock();
    if (::madvise(base_ + off, n, MADV_POPULATE_WRITE) != 0) {
      // Kernels before 5.14: touch one byte per page instead.
      for (uint64_t i = 0; i < n; i += kAlign) base_[off + i] = 0;
    }
    const bool locked = ::mlock(base_ + off, n) == 0;
    lock.lock();
    resident_ = off + n;
    locked_ = locked_ && locked;
    cv_.notify_all();
    if (resident_ == target_ && on_grown_ && !stop_) {
      const uint64_t resident = resident_;
      lock.unlock();
      on_grown_(base_, resident);
      lock.lock();
    }
  }
}

void StagingPool::WaitPrefaulted() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return stop_ || resident_ >= target_; });
}

uint64_t StagingPool::resident_bytes() const {
  std::lock_guard lock(mu_);
  return resident_;
}

bool StagingPool::locked() const {
  std::lock_guard lock(mu_);
  return locked_ && resident_ > 0;
}

std::optional<uint64_t> StagingPool::TryAllocate(uint64_t bytes) {
  bytes = RoundUp(std::max<uint64_t>(bytes, 1), kAlign);
  std::lock_guard lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    uint64_t off = it->first;
    uint64_t rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_[off + bytes] = rest;
    free_bytes_ -= bytes;
    WantResident(off + bytes);
    return off;
  }
  return std::nullopt;
}

void StagingPool::Free(uint64_t offset, uint64_t bytes) {
  bytes = RoundUp(std::max<uint64_t>(bytes, 1), kAlign);
  std::lock_guard lock(mu_);
  auto [it, inserted] = free_.emplace(offset, bytes);
  free_bytes_ += bytes;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

uint64_t StagingPool::free_bytes() const {
  std::lock_guard lock(mu_);
  return free_bytes_;
}

}  // namespace ckptio::pipeline
