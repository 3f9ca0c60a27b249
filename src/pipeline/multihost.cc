// Multi-host saves: many processes, one checkpoint, one atomic commit.
//
//   every process   writes its shards and a fragment (its part of the manifest)
//                   into the checkpoint's shared in-flight location
//   barrier "written/<step>"
//   process 0       reads every fragment, merges them into the manifest and
//                   commits it (the same commit as a single process's)
//   barrier "committed/<step>"
//   every process   succeeds iff the manifest exists; process 0 prunes
//
// With a Barrier object (a callback, MPI) the processes wait in it. With the
// storage-only fallback they poll instead: process 0 until every fragment is
// there, the others until the manifest is. A process that dies makes the
// others fail at the next barrier within multihost.timeout; no manifest is
// written, so the step never exists.

#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "format/manifest.h"
#include "pipeline/fragments.h"
#include "pipeline/manager_impl.h"
#include "runtime/io_ops.h"

namespace ckptio::pipeline {
namespace {

using Json = nlohmann::json;

constexpr std::chrono::milliseconds kFirstManifestPoll{100};  // a follower's first wait for the manifest

}  // namespace

Status ManagerImpl::SetUpMultihost(std::shared_ptr<Barrier> barrier) {
  const Options::MultiHost& mh = options_.multihost;
  if (mh.process_index < 0 || mh.process_index >= mh.process_count) {
    return InvalidArgumentError("multihost.process_index " + std::to_string(mh.process_index) +
                                " is not in [0, process_count = " + std::to_string(mh.process_count) + ")");
  }
  if (!multihost()) return Status::Ok();
  if (mh.barrier == "callback" && barrier == nullptr) {
    return InvalidArgumentError("multihost.barrier is \"callback\" but no Barrier was given to Open");
  }
  if (mh.barrier != "storage") barrier_ = std::move(barrier);
  if (barrier_ != nullptr) barrier_thread_ = std::make_unique<runtime::CpuPool>(1, "ckptio-barrier");
  return Status::Ok();
}

Task<Status> ManagerImpl::BarrierWait(std::string name) {
  if (barrier_ == nullptr) co_return Status::Ok();
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kCommit, "barrier " + name);
  auto wait = [barrier = barrier_, name, timeout = options_.multihost.timeout] { return barrier->Wait(name, timeout); };
  co_return co_await barrier_thread_->Run(wait);
}

Task<Status> ManagerImpl::WriteFragment(SaveJob* job, storage::CheckpointWriter* writer, const Status& written) {
  format::Manifest part;
  if (written.ok()) part = MakeManifest(job->plan, job->tensor_crc, job->shard_crc, nlohmann::json::object());
  std::string fragment = MakeFragment(std::move(part), job->plan.step, options_.multihost.process_index,
                                      options_.multihost.process_count, written);
  co_return co_await writer->WriteSmall(FragmentName(options_.multihost.process_index), std::move(fragment));
}

Task<Result<format::Manifest>> ManagerImpl::GatherFragments(SaveJob* job, storage::CheckpointWriter* writer) {
  GatherSpec spec{options_.multihost.process_count, job->plan.step, StepName(job->plan.step),
                  options_.multihost.timeout, /*poll=*/barrier_ == nullptr, job->metadata};
  co_return co_await pipeline::GatherFragments(loop(), writer, std::move(spec));
}

Task<Status> ManagerImpl::AwaitCommit(int64_t step) {
  const auto deadline = Clock::now() + options_.multihost.timeout;
  PollBackoff backoff(options_.multihost.process_count, kFirstManifestPoll);
  for (;;) {
    auto bytes = co_await storage_->ReadSmallFile(StepName(step), "manifest.json", format::kMaxManifestBytes);
    if (bytes.ok()) {
      auto m = format::ParseManifest(StepName(step) + "/manifest.json", *bytes);
      if (m.ok() && m->step == step) co_return Status::Ok();
    } else if (bytes.status().code() != StatusCode::kNotFound) {
      co_return bytes.status();
    }
    if (barrier_ != nullptr || Clock::now() >= deadline) {
      co_return UnavailableError("step " + std::to_string(step) + " was not committed by process 0" +
                                 (barrier_ != nullptr ? "" : " within " +
                                  std::to_string(options_.multihost.timeout.count()) + " ms") +
                                 " (its log says why)");
    }
    Status slept = co_await loop().Sleep(backoff.Next(deadline));
    slept.IgnoreError();
  }
}

Task<Status> ManagerImpl::PersistShared(SaveJob* job) {
  const int64_t step = job->plan.step;
  const std::string steps = std::to_string(step);
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(StepName(step), options_.overwrite, /*shared=*/true));
  Status s = co_await WriteShards(job, writer.get());
  ReleaseStaging(job);
  Status fragment = co_await WriteFragment(job, writer.get(), s);
  if (s.ok()) s = fragment;
  if (job->previous) {
    co_await job->previous->ended.Wait();  // commits happen in admission order
    job->previous.reset();
  }
  Status arrived = co_await BarrierWait("written/" + steps);
  Status committed = arrived;
  if (arrived.ok() && leader()) {
    auto merged = co_await GatherFragments(job, writer.get());
    if (merged.ok()) {
      runtime::ScopedSpan span(tracer_.get(), runtime::Track::kCommit, "commit " + steps);
      committed = co_await writer->Commit(format::SerializeManifest(*merged));
    } else {
      committed = merged.status();
    }
  }
  if (arrived.ok()) {
    // Everybody learns the outcome here, process 0 included, so that a
    // failed commit does not leave the others waiting out their timeout.
    Status done = co_await BarrierWait("committed/" + steps);
    if (!leader() && committed.ok()) {
      if (done.ok()) {
        committed = co_await AwaitCommit(step);
      } else {
        committed = std::move(done);
      }
    }
  }
  if (!s.ok() || !committed.ok()) {
    Status aborted = co_await writer->Abort();  // shared: only our own files
    aborted.IgnoreError();
    co_return s.ok() ? committed : s;
  }
  co_return Status::Ok();
}

}  // namespace ckptio::pipeline
