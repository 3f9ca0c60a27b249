// Incremental saves and the references they create: choosing what a save
// writes, and retention that keeps every file a kept step refers to.
#include "base/status_macros.h"
#include "pipeline/host_part.h"
#include "pipeline/manager_impl.h"

namespace ckptio::pipeline {

Task<Status> ManagerImpl::PlanIncremental(SaveJob* job) {
  // The base: the newest committed step, pinned against pruning and
  // deletion until this save has committed (its files stay referenced).
  std::shared_ptr<const IncrementalBase> base;
  std::optional<int64_t> latest;
  {
    std::lock_guard lock(mu_);
    if (!committed_.empty()) latest = *committed_.rbegin();
    if (base_ && latest && *latest == base_->step) base = base_;
    if (latest) readers_.insert(*latest);
  }
  if (latest && !base) {
    // The first incremental save of this manager over earlier checkpoints.
    auto read = co_await ReadHeldManifest(*latest);
    if (read.ok()) {
      base = std::make_shared<IncrementalBase>(IncrementalBase{*latest, StepName(*latest), std::move(read).value()});
      std::lock_guard lock(mu_);
      if (!base_ || base_->step < *latest) base_ = base;
    }
    // Unreadable: this save is written whole (and says nothing: the step's
    // own readers will report its damage).
  }
  if (base) {
    job->base = base;
    job->reuse = MatchBase(job->plan, job->tensor_crc, job->tensor_hash, base->manifest);
    // A tensor of the checkpoint never points into a local copy's file (only
    // this host has it); a local copy may point into either.
    for (size_t i = 0; i < job->reuse.size(); ++i) {
      const std::optional<size_t>& r = job->reuse[i];
      if (r && !job->plan.local_copy[i] &&
          IsLocalCopyFile(base->manifest.shards[base->manifest.tensors[*r].shard].name)) {
        job->reuse[i].reset();
      }
    }
  } else {
    if (latest) Unpin(*latest);
    job->reuse.assign(job->plan.specs.size(), std::nullopt);
  }
  job->reusing = std::any_of(job->reuse.begin(), job->reuse.end(), [](const auto& r) { return r.has_value(); });
  if (job->reusing) {
    CO_ASSIGN_OR_RETURN(job->changed, PlanChanged(job->plan, job->region, job->reuse, options_, &job->changed_from));
    job->images = MakeImages(job->changed, nullptr);
    job->shard_crc.assign(job->images.size(), 0);
    for (size_t i = 0; i < job->images.size(); ++i) {
      job->images[i].progress = &job->state->bytes_written;
      job->images[i].crc32c = &job->shard_crc[i];
      job->images[i].crc_ready = &job->crc_ready;
    }
  }
  FinishCrcs(job);
  co_return Status::Ok();
}

Task<Status> ManagerImpl::LoadReferences() {
  std::vector<int64_t> unknown;
  {
    std::lock_guard lock(mu_);
    for (int64_t step : committed_) {
      if (refs_.count(step) == 0) unknown.push_back(step);
    }
  }
  for (int64_t step : unknown) {
    auto m = co_await ReadManifest(step);
    References refs;
    if (m.ok()) {
      AddReferences(*m, &refs);
      // A host's local copies may refer to its earlier local copies.
      auto part = co_await ReadLocalPart(step);
      if (part.ok()) AddReferences(*part, &refs);
    } else if (m.status().code() != StatusCode::kNotFound && m.status().code() != StatusCode::kCorruption) {
      // Not knowing what a kept step refers to, nothing may be removed.
      co_return std::move(m).status().WithContext("cannot read the manifest of step " + std::to_string(step));
    }
    refs_[step] = std::move(refs);
  }
  co_return Status::Ok();
}

Task<Result<format::Manifest>> ManagerImpl::ReadLocalPart(int64_t step) {
  if (!per_host()) co_return NotFoundError("no local part outside a multi-host job with two tiers");
  const std::string path = root_ + "/" + StepName(step) + "/" + kLocalPartFile;
  CO_ASSIGN_OR_RETURN(std::string bytes,
                      co_await storage_->ReadSmallFile(StepName(step), kLocalPartFile, format::kMaxManifestBytes));
  co_return format::ParseManifest(path, bytes, format::Chunks::kPartial);
}

Task<Result<format::Manifest>> ManagerImpl::ReadHeldManifest(int64_t step) {
  CO_ASSIGN_OR_RETURN(format::Manifest m, co_await ReadManifest(step));
  if (!multihost()) co_return std::move(m);
  auto part = co_await ReadLocalPart(step);
  co_return HeldPart(m, part.ok() ? &*part : nullptr, options_.multihost.process_index);
}

References ManagerImpl::Referenced() const {
  std::set<int64_t> kept;
  {
    std::lock_guard lock(mu_);
    kept = committed_;
    kept.insert(readers_.begin(), readers_.end());
  }
  References out;
  for (const auto& [step, refs] : refs_) {
    if (kept.count(step) == 0) continue;
    for (const auto& [name, files] : refs) out[name].insert(files.begin(), files.end());
  }
  return out;
}

Task<Status> ManagerImpl::RemoveUnreferenced(std::string name, bool prune, const References& referenced) {
  auto it = referenced.find(name);
  if (it == referenced.end()) {
    retired_.erase(name);
    // Tasks made before the co_await (g++ 12 and temporaries, STYLE.md).
    Task<Status> remove = prune ? storage_->Prune(std::move(name)) : storage_->Remove(std::move(name));
    co_return co_await std::move(remove);
  }
  // Its manifest goes (the step is gone), the files kept steps use stay.
  retired_[name] = it->second;
  std::vector<std::string> keep(it->second.begin(), it->second.end());
  Task<Status> remove = storage_->RemoveExcept(name, std::move(keep));
  co_return co_await std::move(remove);
}

Task<Status> ManagerImpl::CheckNotReferenced(int64_t step) {
  const std::string name = StepName(step);
  bool committed = false;
  {
    std::lock_guard lock(mu_);
    committed = committed_.count(step) != 0;
  }
  if (retired_.count(name) == 0 && !(options_.overwrite && committed)) co_return Status::Ok();
  CO_TRY(co_await LoadReferences());
  const References referenced = Referenced();
  if (referenced.count(name) == 0) co_return Status::Ok();
  std::string users;
  for (const auto& [user, refs] : refs_) {
    if (refs.count(name) != 0) users += (users.empty() ? "" : ", ") + std::to_string(user);
  }
  co_return FailedPreconditionError(name + (committed ? "'s" : " was pruned, but its") + " files are used by step" +
                                    (users.find(',') != std::string::npos ? "s " : " ") + users +
                                    " (incremental saves): saving step " + std::to_string(step) +
                                    " again would replace them. Delete those steps first, or save under another "
                                    "step or root");
}

Task<Status> ManagerImpl::CollectRetired(const References& referenced) {
  Status first;
  std::vector<std::string> names;
  for (const auto& [name, kept] : retired_) {
    auto it = referenced.find(name);
    if (it == referenced.end() || it->second != kept) names.push_back(name);
  }
  for (const std::string& name : names) {
    Status s = co_await RemoveUnreferenced(name, /*prune=*/false, referenced);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  co_return first;
}

}  // namespace ckptio::pipeline
