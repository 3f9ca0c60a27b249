#include "pipeline/stream_copy.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace ckptio::pipeline {
namespace {

__attribute__((target("avx2"))) void StreamCopyAvx2(char* dst, const char* src, size_t n) {
  // Head: bring dst to a 32-byte boundary with an ordinary copy.
  size_t head = (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  // Streaming stores are weakly ordered: fence so that whoever is told the
  // copy is done (another thread, the kernel's DMA) sees every byte.
  _mm_sfence();
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

}  // namespace

void StreamCopy(void* dst, const void* src, size_t n) {
  if (n >= 4096 && HasAvx2()) {
    StreamCopyAvx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace ckptio::pipeline
