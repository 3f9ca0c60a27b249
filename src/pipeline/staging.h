#pragma once
// StagingPool: the memory every copy-mode save copies its snapshot into.
//
// One reserved range of address space, `limit` bytes long, of which saves
// take regions first-fit and give them back when their shards are durable:
// never an allocation per save. Memory is spent only on the part of the
// range made resident: a first-touch fault costs ~17 us per 4 KiB page on
// this VM, 50x a warm memcpy, so pages are faulted in (and mlock-ed where
// allowed: an idle VM pages out memory untouched for a minute) by a
// background thread, never freed while the pool lives, and reused by every
// later save.
//
// How much is made resident: Create's `resident` bytes at once (an explicit
// staging_memory: the first save then copies into warm memory if it comes
// after the background pre-fault), and then whatever regions TryAllocate
// hands out beyond that ("auto": a 32-byte save costs a few pages, not
// gigabytes). A save whose region is not resident yet does not wait for
// the background thread: its copy faults the missing pages itself, on
// every CPU pool thread, while the background thread works ahead.
//
// The pre-fault waits while a restore runs (HoldPrefault): on this VM,
// faulting in 2 GiB of staging while a restore faulted in its own 1 GiB of
// fresh buffers made the restore take 2.6-6.6 s instead of 1.0 s (8 CPU
// devices, bench/pods_bench.py). A restart restores first and saves later,
// so the pre-fault still ends before the first save in a training loop.
//
// No transparent huge pages: on this VM a huge-page fault with compaction
// took 1.2-2.8 s per GiB against 0.4-0.55 s for small pages, and warm copies
// were no faster (bench/results/micro.md).
//
// Thread-safety: all methods are thread-safe.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "ckptio/status.h"

namespace ckptio::pipeline {

class StagingPool {
 public:
  static constexpr uint64_t kAlign = 4096;  // O_DIRECT needs block-aligned buffers
  // The resident part grows in steps of this size.
  static constexpr uint64_t kGrowStep = uint64_t{2} << 20;

  // `on_grown(base, resident)` runs on the pre-fault thread each time the
  // resident part [base, base + resident) has caught up with what was asked
  // for (not after StopPrefault()). It may run before Create() returns.
  using GrownFn = std::function<void(char* base, uint64_t resident)>;
  // `limit`: the most bytes the pool hands out (address space only);
  // `resident`: bytes to fault in right away, in the background (`held`:
  // once a ReleasePrefault() ends the hold Create takes).
  static Result<std::unique_ptr<StagingPool>> Create(uint64_t limit, uint64_t resident, GrownFn on_grown = {},
                                                     bool held = false);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  char* base() const { return base_; }
  // The limit, in whole pages (at least one): a region larger than this can
  // never be had.
  uint64_t capacity() const { return capacity_; }

  // A region of `bytes` (rounded up to kAlign), as an offset from base(), or
  // nullopt if no free region is large enough right now. The region joins
  // the part the background thread keeps resident.
  std::optional<uint64_t> TryAllocate(uint64_t bytes);
  // Returns a region from TryAllocate (same `bytes`).
  void Free(uint64_t offset, uint64_t bytes);
  uint64_t free_bytes() const;

  // Bytes faulted in by the background thread so far, from base().
  uint64_t resident_bytes() const;
  // Blocks until everything asked for so far is resident.
  void WaitPrefaulted();
  // Stops the background thread and waits for it.
  void StopPrefault();
  // While any hold is taken, the background thread starts no new chunk
  // (saves still fault in what they need themselves). Counted: one Release
  // per Hold.
  void HoldPrefault();
  void ReleasePrefault();
  bool locked() const;

 private:
  StagingPool() = default;
  void PrefaultLoop();
  // Raises the resident target to `end` (rounded up to kGrowStep, at most
  // capacity_). REQUIRES: mu_ held.
  void WantResident(uint64_t end);

  char* base_ = nullptr;
  uint64_t capacity_ = 0;
  GrownFn on_grown_;
  std::thread prefault_;

  mutable std::mutex mu_;
  std::condition_variable cv_;         // target_, resident_ or stop_ changed
  std::map<uint64_t, uint64_t> free_;  // offset -> length; guarded by mu_
  uint64_t free_bytes_ = 0;            // guarded by mu_
  uint64_t target_ = 0;                // bytes to make resident; guarded by mu_
  uint64_t resident_ = 0;              // bytes made resident; guarded by mu_
  bool locked_ = true;                 // every mlock so far worked; guarded by mu_
  bool stop_ = false;                  // guarded by mu_
  int holds_ = 0;                      // HoldPrefault - ReleasePrefault; guarded by mu_
};

}  // namespace ckptio::pipeline
