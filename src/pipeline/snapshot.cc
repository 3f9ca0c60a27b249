#include "pipeline/snapshot.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "runtime/when_all.h"
#include "format/crc32c.h"
#include "pipeline/stream_copy.h"

namespace ckptio::pipeline {

void CopySnapshot(runtime::CpuPool& pool, const SavePlan& plan, char* region, const std::vector<Chunk>& chunks,
                  std::vector<uint32_t>* chunk_crc) {
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    std::memcpy(region + plan.image_offset[s], plan.shards[s].prefix.data(), plan.shards[s].prefix.size());
  }
  // The caller plus one worker per remaining core: more threads than cores
  // would only make the copies contend.
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  pool.ParallelFor(
      chunks.size(),
      [&](size_t i) {
        const Chunk& c = chunks[i];
        if (chunk_crc != nullptr) {
          // Fused: an ordinary copy leaves the chunk in cache for the CRC.
          std::memcpy(c.dst, c.src, c.len);
          (*chunk_crc)[i] = format::Crc32c(c.dst, c.len);
        } else {
          StreamCopy(c.dst, c.src, c.len);
        }
      },
      cores - 1);
}

namespace {
struct CrcWork {
  runtime::CpuPool* pool;
  const std::vector<Chunk>* chunks;
  std::vector<uint32_t>* out;
  std::vector<format::Hash128>* hashes;
  size_t next = 0;
};

Task<void> CrcLane(CrcWork* w) {
  while (w->next < w->chunks->size()) {
    size_t i = w->next++;
    const Chunk* c = &(*w->chunks)[i];
    uint32_t* crc = w->out != nullptr ? &(*w->out)[i] : nullptr;
    format::Hash128* hash = w->hashes != nullptr ? &(*w->hashes)[i] : nullptr;
    auto job = [c, crc, hash] {
      const char* bytes = c->dst != nullptr ? c->dst : c->src;
      if (crc != nullptr) *crc = format::Crc32c(bytes, c->len);
      if (hash != nullptr) *hash = format::Xxh3(bytes, c->len);
    };
    co_await w->pool->Run(job);
  }
}
}  // namespace

Task<void> ComputeChunkCrcs(runtime::CpuPool& pool, const std::vector<Chunk>* chunks, std::vector<uint32_t>* out,
                            size_t lanes, std::vector<format::Hash128>* hashes) {
  CrcWork work{&pool, chunks, out, hashes, 0};
  std::vector<Task<void>> tasks;
  for (size_t i = 0; i < std::max<size_t>(lanes, 1); ++i) tasks.push_back(CrcLane(&work));
  co_await WhenAll(std::move(tasks));
}

}  // namespace ckptio::pipeline
