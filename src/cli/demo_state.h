#pragma once
// DemoState: the simulated trainer state of `ckptio demo`.
//
// About 100 tensors of mixed dtypes and sizes named like a transformer's
// (`layers/12/mlp/kernel`), in one anonymous mapping that the demo owns, with
// each tensor 4 KiB-aligned. Compute() is the "training step": busy work on
// the caller's thread that also writes into every tensor, so a save that did
// not snapshot the bytes would see them change under it.
//
// With two buffer sets the state is double-buffered like a JAX trainer's: a
// step returns new arrays and never mutates the old ones. Compute() then
// writes the whole next state into the other set, computed from the current
// one, and makes it current; the set it left stays unchanged until the
// Compute() after next, so a save may borrow it (snapshot "borrow") for one
// whole compute period.
//
// Not thread-safe: the trainer thread alone calls Compute(); the manager
// reads the tensors during Save() (copy mode) or until the save ends (borrow
// mode, which needs two sets and a caller that waits for that save before
// the Compute() that overwrites the set it borrowed).

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
  // A state of exactly `bytes` bytes of tensor data (>= 4 KiB), in `sets`
  // buffer sets (1, or 2 for a double-buffered state), all filled alike.
  static Result<DemoState> Create(uint64_t bytes, int sets = 1);
  DemoState(DemoState&& other) noexcept;
  DemoState& operator=(DemoState&&) = delete;
  DemoState(const DemoState&) = delete;
  DemoState& operator=(const DemoState&) = delete;
  ~DemoState();

  // The current state: the set the last Compute() wrote.
  std::span<const TensorRef> tensors() const { return sets_[current_]; }
  // The set the next Compute() writes (the current one with one set).
  std::span<const TensorRef> next_tensors() const { return sets_[NextSet()]; }
  // Bytes of tensor data of one set.
  uint64_t bytes() const { return bytes_; }
  int sets() const { return static_cast<int>(sets_.size()); }
  int current_set() const { return current_; }
  // "F32, BF16, ..." of the dtypes present, for the demo's heading.
  std::string DTypeSummary() const;

  // Busy work for `duration` that increments a strided subset of the bytes
  // of every tensor (a different subset each pass). With two sets it first
  // writes every byte of the other set from the current one (however long
  // that takes, even past `duration`), then works on that set, which ends
  // up current.
  void Compute(std::chrono::nanoseconds duration);

 private:
  DemoState() = default;
  int NextSet() const { return (current_ + 1) % static_cast<int>(sets_.size()); }
  std::byte* MutableData(int set, size_t i) const;
  // out = in + 1 in every 64-bit word of each tensor (then the bytes left).
  void WriteNextState(int from, int to);

  std::byte* base_ = nullptr;  // the mapping
  size_t mapped_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::vector<TensorRef>> sets_;  // each a whole state, same names and shapes
  int current_ = 0;
  std::vector<uint64_t> sizes_;  // bytes of each tensor
  uint64_t phase_ = 0;
};

}  // namespace ckptio::cli
