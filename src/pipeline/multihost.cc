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

#include <cctype>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "format/manifest.h"
#include "pipeline/fragments.h"
#include "pipeline/host_part.h"
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

Task<Result<std::vector<std::string>>> ManagerImpl::Exchange(std::string name, std::string bytes) {
  if (barrier_ == nullptr) {
    co_return UnimplementedError("all-gather \"" + name + "\": the storage-only barrier cannot exchange bytes");
  }
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kCommit, "all-gather " + name);
  if (!exchange_through_remote_) {
    // Each host's root is its own: the remote tier they share names the
    // job's exchanges (two managers of one job never mix theirs).
    auto gather = [barrier = barrier_, name = options_.tiers.remote + " " + name, bytes,
                   timeout = options_.multihost.timeout] { return barrier->AllGather(name, bytes, timeout); };
    Result<std::vector<std::string>> all = co_await barrier_thread_->Run(gather);
    if (all.ok() && all->size() != static_cast<size_t>(options_.multihost.process_count)) {
      co_return InternalError("all-gather \"" + name + "\" returned " + std::to_string(all->size()) +
                              " parts for " + std::to_string(options_.multihost.process_count) + " processes");
    }
    if (all.ok() || all.status().code() != StatusCode::kUnimplemented || !remote_) co_return all;
    exchange_through_remote_ = true;  // a barrier that can only wait: from now on, through the remote tier
  }
  co_return co_await ExchangeThroughRemote(std::move(name), std::move(bytes));
}

Task<Result<std::vector<std::string>>> ManagerImpl::ExchangeThroughRemote(std::string name, std::string bytes) {
  const Options::MultiHost& mh = options_.multihost;
  std::unique_ptr<storage::CheckpointWriter> mine;
  Task<Status> put = remote_->PutExchange(name, mh.process_index, std::move(bytes), &mine);
  Status s = co_await runtime::OnLoop(remote_->loop(), std::move(put));
  // Every process reaches both barriers, so that a failure here stops none
  // of the others short of its timeout.
  Status written = co_await BarrierWait(name + " (written)");
  if (s.ok()) s = written;
  Result<std::vector<std::string>> all = s;
  if (s.ok()) {
    Task<Result<std::vector<std::string>>> get = remote_->GetExchange(name, mh.process_count);
    all = co_await runtime::OnLoop(remote_->loop(), std::move(get));
  }
  Status read = co_await BarrierWait(name + " (read)");
  if (mine) {  // its file goes once every process has read it
    Task<Status> drop = remote_->DropExchange(std::move(mine));
    Status dropped = co_await runtime::OnLoop(remote_->loop(), std::move(drop));
    dropped.IgnoreError();  // left for the next exchange of the name to overwrite
  }
  if (all.ok() && !read.ok()) co_return read;
  co_return all;
}

namespace {

// Where the processes swap bytes through the remote tier: a name no step
// has, its files "<name, as a plain file name>.p00003".
constexpr const char* kExchangeDir = ".ckptio-exchange";

std::string ExchangeFile(const std::string& name, int process) {
  std::string file;
  for (char c : name) file += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  char p[16];
  std::snprintf(p, sizeof p, ".p%05d", process);
  return file + p;
}

}  // namespace

Task<Status> ManagerImpl::PutExchange(std::string name, int process, std::string bytes,
                                      std::unique_ptr<storage::CheckpointWriter>* writer) {
  CO_ASSIGN_OR_RETURN(*writer, co_await storage_->StartCheckpoint(kExchangeDir, /*replace=*/false, /*shared=*/true));
  co_return co_await (*writer)->WriteSmall(ExchangeFile(name, process), std::move(bytes));
}

Task<Result<std::vector<std::string>>> ManagerImpl::GetExchange(std::string name, int count) {
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> reader,
                      co_await storage_->StartCheckpoint(kExchangeDir, /*replace=*/false, /*shared=*/true));
  std::vector<Task<Result<std::string>>> reads;
  for (int p = 0; p < count; ++p) reads.push_back(reader->ReadSmall(ExchangeFile(name, p), format::kMaxManifestBytes));
  std::vector<Result<std::string>> got = co_await WhenAll(std::move(reads));
  std::vector<std::string> out;
  for (int p = 0; p < count; ++p) {
    if (!got[p].ok()) {
      co_return std::move(got[p]).status().WithContext("process " + std::to_string(p) + "'s part of \"" + name +
                                                       "\" in " + root_ + "/" + kExchangeDir);
    }
    out.push_back(std::move(got[p]).value());
  }
  co_return out;
}

Task<Status> ManagerImpl::DropExchange(std::unique_ptr<storage::CheckpointWriter> writer) {
  co_return co_await writer->Abort();  // shared: its own files only
}

Task<Status> ManagerImpl::AgreeOnLocalSteps(Status opened) {
  const Options::MultiHost& mh = options_.multihost;
  Json mine = {{"remote", options_.tiers.remote}, {"count", mh.process_count}};
  if (opened.ok()) {
    mine["steps"] = AllSteps();
  } else {
    mine["error"] = opened.message();
  }
  Task<Result<std::vector<std::string>>> exchanging = Exchange("open", mine.dump());
  Result<std::vector<std::string>> all = co_await std::move(exchanging);
  if (!all.ok()) {
    if (all.status().code() == StatusCode::kUnimplemented) {
      co_return InvalidArgumentError(
          "two tiers in a multi-host job (tiers.remote with multihost.process_count " +
          std::to_string(mh.process_count) +
          "): the processes swap their parts of each manifest, which the storage-only fallback cannot order "
          "(" + all.status().message() + "). Give Open a barrier: MpiBarrier(), jax.distributed or "
          "torch.distributed (Python), or a CallbackBarrier (with an all-gather function, or without: the "
          "parts then go through the remote tier)");
    }
    co_return std::move(all).status().WithContext("cannot open " + root_ + " as the local tier of process " +
                                                  std::to_string(mh.process_index));
  }
  CO_TRY(opened);
  std::set<int64_t> agreed(committed_.begin(), committed_.end());
  for (size_t p = 0; p < all->size(); ++p) {
    const std::string who = "process " + std::to_string(p);
    Json theirs = Json::parse((*all)[p], nullptr, /*allow_exceptions=*/false);
    if (!theirs.is_object()) co_return InternalError(who + " sent an unreadable answer to \"open\"");
    if (theirs.contains("error")) {
      co_return UnavailableError(who + " cannot open its local tier: " + theirs["error"].get<std::string>());
    }
    if (theirs.value("remote", std::string()) != options_.tiers.remote || theirs.value("count", 0) != mh.process_count) {
      co_return InvalidArgumentError(who + " opened with tiers.remote \"" + theirs.value("remote", std::string()) +
                                     "\" and process_count " + std::to_string(theirs.value("count", 0)) +
                                     "; this process (" + std::to_string(mh.process_index) + ") with \"" +
                                     options_.tiers.remote + "\" and " + std::to_string(mh.process_count) +
                                     ": every process must name the same remote tier");
    }
    std::set<int64_t> steps;
    for (const Json& step : theirs.value("steps", Json::array())) {
      if (step.is_number_integer()) steps.insert(step.get<int64_t>());
    }
    std::erase_if(agreed, [&](int64_t step) { return steps.count(step) == 0; });
  }
  std::lock_guard lock(mu_);
  agreed_ = std::move(agreed);
  co_return Status::Ok();
}

Task<Status> ManagerImpl::WriteFragment(SaveJob* job, storage::CheckpointWriter* writer, const Status& written) {
  format::Manifest part;
  Status s = written;
  if (s.ok()) {
    Result<format::Manifest> built = BuildManifest(job, format::Chunks::kPartial);
    if (built.ok()) {
      part = std::move(built).value();
    } else {
      s = built.status();
    }
  }
  std::string fragment = MakeFragment(std::move(part), job->plan.step, options_.multihost.process_index,
                                      options_.multihost.process_count, s);
  Status wrote = co_await writer->WriteSmall(FragmentName(options_.multihost.process_index), std::move(fragment));
  co_return s.ok() ? wrote : s;
}

Task<Result<format::Manifest>> ManagerImpl::GatherFragments(SaveJob* job, storage::CheckpointWriter* writer) {
  GatherSpec spec{options_.multihost.process_count, job->plan.step, StepName(job->plan.step),
                  options_.multihost.timeout, /*poll=*/barrier_ == nullptr, job->metadata, {}, {}};
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
      // Process 0 prunes the root: it must know every process's references.
      job->references.clear();
      AddReferences(*merged, &job->references);
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

namespace {

// The manifest every host commits: the processes' parts, swapped, merged in
// process order (process 0's user metadata and creation time), so that
// every host commits the same bytes.
Result<format::Manifest> MergeSwapped(const std::vector<std::string>& parts, int64_t step,
                                      const std::string& step_name, std::vector<int64_t>* skips) {
  std::vector<format::Manifest> fragments;
  for (size_t p = 0; p < parts.size(); ++p) {
    ASSIGN_OR_RETURN(format::Manifest f,
                     format::ParseManifest(step_name + "/" + FragmentName(static_cast<int>(p)) + " (process " +
                                               std::to_string(p) + "'s part, swapped)",
                                           parts[p], format::Chunks::kPartial));
    if (f.step != step) {
      return InternalError("process " + std::to_string(p) + " sent its part of step " + std::to_string(f.step) +
                           " while this process commits step " + std::to_string(step) +
                           ": the processes do not save the same steps in the same order");
    }
    fragments.push_back(std::move(f));
  }
  nlohmann::json metadata = nlohmann::json::object();
  if (!fragments.empty()) {
    metadata = fragments[0].metadata.value("user", nlohmann::json::object());
    for (const Json& skip : fragments[0].metadata.value("remote_skip", Json::array())) {
      if (skip.is_number_integer()) skips->push_back(skip.get<int64_t>());
    }
  }
  return MergeFragments(fragments, step, step_name, std::move(metadata));
}

}  // namespace

Task<Status> ManagerImpl::PersistPerHost(SaveJob* job) {
  const int64_t step = job->plan.step;
  const std::string name = StepName(step);
  const Options::MultiHost& mh = options_.multihost;
  // Every failure below still reaches the exchange, so that the other hosts
  // hear of it at once instead of at their timeout.
  Status s = co_await CheckNotReferenced(step);
  std::unique_ptr<storage::CheckpointWriter> writer;
  if (s.ok()) {
    auto started = co_await storage_->StartCheckpoint(name, options_.overwrite);
    if (started.ok()) {
      writer = std::move(started).value();
    } else {
      s = started.status();
    }
  }
  if (s.ok()) s = co_await WriteShards(job, writer.get());
  ReleaseStaging(job);
  format::Manifest held;  // this process's files and its local copies
  if (s.ok()) {
    Result<format::Manifest> built = BuildManifest(job, format::Chunks::kPartial);
    if (built.ok()) {
      held = std::move(built).value();
    } else {
      s = built.status();
    }
  }
  if (job->previous) {
    co_await job->previous->ended.Wait();  // commits (and exchanges) happen in admission order
    job->previous.reset();
  }
  format::Manifest own = FilterShards(held, [](const format::ManifestShard& f) { return !IsLocalCopyFile(f.name); });
  Json extra = {{"user", job->metadata}};
  if (leader()) extra["remote_skip"] = PlanReplicationSkips(step);
  std::string part = MakeFragment(std::move(own), step, mh.process_index, mh.process_count, s, std::move(extra));
  Task<Result<std::vector<std::string>>> exchanging = Exchange("written/" + std::to_string(step), std::move(part));
  Result<std::vector<std::string>> parts = co_await std::move(exchanging);
  std::vector<int64_t> skips;  // process 0's decision: copies to the remote tier that do not happen
  Result<format::Manifest> merged = parts.ok() ? MergeSwapped(*parts, step, name, &skips) : parts.status();
  ApplyReplicationSkips(skips);
  if (s.ok()) s = merged.status();
  if (s.ok()) {
    // The local copies' index first: the commit makes both visible at once.
    format::Manifest local =
        FilterShards(held, [](const format::ManifestShard& f) { return IsLocalCopyFile(f.name); });
    local.metadata = {{"process_index", mh.process_index}, {"process_count", mh.process_count}};
    s = co_await writer->WriteSmall(kLocalPartFile, format::SerializeManifest(local));
  }
  if (s.ok()) {
    runtime::ScopedSpan span(tracer_.get(), runtime::Track::kCommit, "commit " + std::to_string(step));
    s = co_await writer->Commit(format::SerializeManifest(*merged));
  }
  if (!s.ok()) {
    if (writer) {
      Status aborted = co_await writer->Abort();
      aborted.IgnoreError();
    }
    co_return s;
  }
  AddReferences(*merged, &job->references);
  std::lock_guard lock(mu_);
  agreed_.insert(step);
  co_return Status::Ok();
}

}  // namespace ckptio::pipeline
