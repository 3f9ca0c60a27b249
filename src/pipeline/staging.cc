#include "pipeline/staging.h"

#include <sys/mman.h>
#include <pthread.h>

#include <cerrno>
#include <cstring>

namespace ckptio::pipeline {
namespace {
constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kPrefaultChunk = uint64_t{64} << 20;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }
}  // namespace

Result<std::unique_ptr<StagingPool>> StagingPool::Create(uint64_t bytes, PrefaultedFn on_prefaulted) {
  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->on_prefaulted_ = std::move(on_prefaulted);
  pool->capacity_ = RoundUp(std::max<uint64_t>(bytes, kAlign), kHugePage);
  // Over-map by one huge page so the start can be huge-page aligned.
  size_t map_len = pool->capacity_ + kHugePage;
  void* p = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno, "cannot allocate " + std::to_string(pool->capacity_) +
                                    " bytes of staging memory (staging_memory)");
  }
  auto raw = reinterpret_cast<uintptr_t>(p);
  uintptr_t aligned = RoundUp(raw, kHugePage);
  if (aligned > raw) ::munmap(p, aligned - raw);
  uintptr_t end = aligned + pool->capacity_;
  if (raw + map_len > end) ::munmap(reinterpret_cast<void*>(end), raw + map_len - end);
  pool->base_ = reinterpret_cast<char*>(aligned);
  pool->huge_pages_ = ::madvise(pool->base_, pool->capacity_, MADV_HUGEPAGE) == 0;
  pool->free_[0] = pool->capacity_;
  pool->free_bytes_ = pool->capacity_;
  StagingPool* raw_pool = pool.get();
  pool->prefault_ = std::thread([raw_pool] { raw_pool->Prefault(); });
  return pool;
}

StagingPool::~StagingPool() {
  StopPrefault();
  if (base_ != nullptr) ::munmap(base_, capacity_);
}

void StagingPool::StopPrefault() {
  stop_ = true;
  if (prefault_.joinable()) prefault_.join();
}

void StagingPool::Prefault() {
  pthread_setname_np(pthread_self(), "ckptio-prefault");
  for (uint64_t off = 0; off < capacity_ && !stop_; off += kPrefaultChunk) {
    uint64_t n = std::min(kPrefaultChunk, capacity_ - off);
    if (::madvise(base_ + off, n, MADV_POPULATE_WRITE) != 0) {
      // Kernels before 5.14: touch one byte per page instead.
      for (uint64_t i = 0; i < n; i += kAlign) base_[off + i] = 0;
    }
  }
  if (!stop_) locked_ = ::mlock(base_, capacity_) == 0;
  if (!stop_ && on_prefaulted_) on_prefaulted_(base_, capacity_);
  prefault_done_ = true;
  prefault_done_.notify_all();
}

void StagingPool::WaitPrefaulted() { prefault_done_.wait(false); }

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
