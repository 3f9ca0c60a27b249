// XXH3-128 compiled with -mavx2 (meson.build), called by content_hash.cc only
// on CPUs that have AVX2: 45 GB/s against 16 GB/s for the SSE2 build on this VM.
#include "format/content_hash.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ckptio::format {
Hash128 Xxh3Avx2(const void* data, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(data, n);
  return {h.high64, h.low64};
}
}  // namespace ckptio::format
