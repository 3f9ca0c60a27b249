#pragma once
// A deterministic trainer state: the bytes of every tensor are a function of
// (name, step), so a test can check a restored checkpoint without keeping the
// state, even across processes (crash tests).

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ckptio/tensor.h"
#include "base/dtype.h"

namespace ckptio::testing {

struct OwnedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  Bytes bytes;
  TensorRef ref() const { return {name, dtype, shape, bytes.data()}; }
};

inline OwnedTensor MakeTensor(std::string name, DType dtype, std::vector<uint64_t> shape, int64_t step) {
  uint64_t n = base::TensorBytes(dtype, shape).value();
  OwnedTensor t{std::move(name), dtype, std::move(shape), Bytes(n)};
  std::mt19937_64 rng(std::hash<std::string>{}(t.name) ^ static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(&t.bytes[i], &v, 8);
  }
  for (; i < n; ++i) t.bytes[i] = static_cast<std::byte>(rng());
  return t;
}

// `count` F32 tensors of `elems` elements each.
inline std::vector<OwnedTensor> MakeState(int64_t step, size_t count, uint64_t elems) {
  std::vector<OwnedTensor> ts;
  for (size_t i = 0; i < count; ++i) {
    ts.push_back(MakeTensor("layer" + std::to_string(i) + "/w", DType::kF32, {elems / 4, 4}, step));
  }
  return ts;
}

// The crash tests' state at `step` (tests/tools/crash_saver): six tensors of
// 200,000 F32 elements, of which the first three never change, so that an
// incremental save refers to the shards of an earlier step.
inline std::vector<OwnedTensor> CrashState(int64_t step) {
  std::vector<OwnedTensor> state = MakeState(step, 6, 200'000);
  std::vector<OwnedTensor> frozen = MakeState(0, 3, 200'000);
  for (size_t i = 0; i < frozen.size(); ++i) state[i] = std::move(frozen[i]);
  return state;
}

inline std::vector<TensorRef> Refs(const std::vector<OwnedTensor>& ts) {
  std::vector<TensorRef> r;
  for (const auto& t : ts) r.push_back(t.ref());
  return r;
}

}  // namespace ckptio::testing
