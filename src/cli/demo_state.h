#pragma once
// DemoState: the simulated trainer state of `ckptio demo`.
//
// About 100 tensors of mixed dtypes and sizes named like a transformer's
// (`layers/12/mlp/kernel`), in one anonymous mapping that the demo owns, with
// each tensor 4 KiB-aligned. Compute() is the "training step": busy work on
// the caller's thread that also writes into every tensor, so a save that did
// not snapshot the bytes would see them change under it.
//
// Not thread-safe: the trainer thread alone calls Compute(); the manager
// reads the tensors during Save() (copy mode) only.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckptio/status.h"
#include "ckptio/tensor.h"

namespace ckptio::cli {

class DemoState {
 public:
  // A state of exactly `bytes` bytes of tensor data (>= 4 KiB).
  static Result<DemoState> Create(uint64_t bytes);
  DemoState(DemoState&& other) noexcept;
  DemoState& operator=(DemoState&&) = delete;
  DemoState(const DemoState&) = delete;
  DemoState& operator=(const DemoState&) = delete;
  ~DemoState();

  std::span<const TensorRef> tensors() const { return tensors_; }
  uint64_t bytes() const { return bytes_; }
  // "F32, BF16, ..." of the dtypes present, for the demo's heading.
  std::string DTypeSummary() const;

  // Busy work for `duration` that increments a strided subset of the bytes
  // of every tensor (a different subset each pass).
  void Compute(std::chrono::nanoseconds duration);

 private:
  DemoState() = default;
  std::byte* MutableData(size_t i) const;

  std::byte* base_ = nullptr;  // the mapping
  size_t mapped_ = 0;
  uint64_t bytes_ = 0;
  std::vector<TensorRef> tensors_;
  std::vector<uint64_t> sizes_;  // bytes of each tensor
  uint64_t phase_ = 0;
};

}  // namespace ckptio::cli
