// The public CheckpointManager and SaveHandle: thin forwards to ManagerImpl
// and SaveState.

#include "ckptio/checkpoint_manager.h"

#include "base/status_macros.h"
#include "pipeline/manager_impl.h"

namespace ckptio {

using pipeline::SaveState;

namespace {
class Callback final : public Barrier {
 public:
  Callback(std::function<Status(const std::string&, std::chrono::milliseconds)> fn, AllGatherFn all_gather)
      : fn_(std::move(fn)), all_gather_(std::move(all_gather)) {}
  Status Wait(const std::string& name, std::chrono::milliseconds timeout) override { return fn_(name, timeout); }
  Result<std::vector<std::string>> AllGather(const std::string& name, std::string bytes,
                                             std::chrono::milliseconds timeout) override {
    if (!all_gather_) return Barrier::AllGather(name, std::move(bytes), timeout);
    return all_gather_(name, std::move(bytes), timeout);
  }

 private:
  std::function<Status(const std::string&, std::chrono::milliseconds)> fn_;
  AllGatherFn all_gather_;
};
}  // namespace

Result<std::vector<std::string>> Barrier::AllGather(const std::string& name, std::string bytes,
                                                    std::chrono::milliseconds timeout) {
  (void)bytes;
  (void)timeout;
  return UnimplementedError("barrier \"" + name + "\": this barrier cannot exchange bytes");
}

std::shared_ptr<Barrier> CallbackBarrier(
    std::function<Status(const std::string& name, std::chrono::milliseconds timeout)> fn, AllGatherFn all_gather) {
  return std::make_shared<Callback>(std::move(fn), std::move(all_gather));
}

int64_t SaveHandle::step() const { return state_ ? state_->step : -1; }
bool SaveHandle::skipped() const { return state_ && state_->skipped; }

Status SaveHandle::WaitSnapshot() const {
  if (!state_) return FailedPreconditionError("empty SaveHandle");
  if (state_->skipped) return Wait();
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->snapshot_taken || state_->done; });
  if (!state_->snapshot_taken) return state_->status;  // borrowed: the save has ended
  return state_->snapshot_status;
}

Status SaveHandle::Wait() const {
  if (!state_) return FailedPreconditionError("empty SaveHandle");
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [this] { return state_->done; });
  return state_->status;
}

bool SaveHandle::done() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

std::optional<Status> SaveHandle::status() const {
  if (!state_) return FailedPreconditionError("empty SaveHandle");
  std::lock_guard lock(state_->mu);
  if (!state_->done) return std::nullopt;
  return state_->status;
}

uint64_t SaveHandle::bytes_written() const {
  return state_ ? state_->bytes_written.load(std::memory_order_relaxed) : 0;
}

SaveTimings SaveHandle::timings() const {
  if (!state_) return {};
  std::lock_guard lock(state_->mu);
  return state_->timings;
}

namespace pipeline {

Result<std::unique_ptr<CheckpointManager>> OpenParsedRoot(storage::RootUrl root, Options options, bool read_only,
                                                          std::shared_ptr<Barrier> barrier) {
  ASSIGN_OR_RETURN(auto impl, ManagerImpl::Open(std::move(root), std::move(options), read_only, std::move(barrier)));
  return std::unique_ptr<CheckpointManager>(new CheckpointManager(std::move(impl)));
}

}  // namespace pipeline

Result<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(std::string root, Options options,
                                                                    std::shared_ptr<Barrier> barrier) {
  ASSIGN_OR_RETURN(storage::RootUrl url, storage::ParseRootUrl(root));
  return pipeline::OpenParsedRoot(std::move(url), std::move(options), /*read_only=*/false, std::move(barrier));
}

Result<std::unique_ptr<CheckpointManager>> CheckpointManager::OpenReadOnly(std::string root, Options options) {
  ASSIGN_OR_RETURN(storage::RootUrl url, storage::ParseRootUrl(root));
  return pipeline::OpenParsedRoot(std::move(url), std::move(options), /*read_only=*/true, nullptr);
}

CheckpointManager::CheckpointManager(std::unique_ptr<pipeline::ManagerImpl> impl) : impl_(std::move(impl)) {
  impl_->set_public(this);
}
CheckpointManager::~CheckpointManager() = default;

Result<SaveHandle> CheckpointManager::Save(int64_t step, std::span<const TensorRef> tensors,
                                           std::string metadata_json) {
  return impl_->Save(step, tensors, std::move(metadata_json), nullptr);
}

Result<int64_t> CheckpointManager::ReadInOrder(std::optional<int64_t> step, const OrderedReader& reader,
                                               uint64_t window) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) {
    return m.ReadInOrder(s, reader, window);
  });
}

Result<SaveHandle> CheckpointManager::Save(int64_t step, std::span<const TensorRef> tensors, std::string metadata_json,
                                           std::shared_ptr<const void> keep_alive,
                                           std::optional<SnapshotMode> snapshot, SnapshotCheck check) {
  return impl_->Save(step, tensors, std::move(metadata_json), std::move(keep_alive), snapshot, std::move(check));
}
void CheckpointManager::WaitSnapshots() { impl_->WaitSnapshots(); }
Status CheckpointManager::WaitUntilFinished() { return impl_->WaitUntilFinished(); }
Status CheckpointManager::WaitUntilFinished(Tier tier) {
  Status local = impl_->WaitUntilFinished();
  if (tier == Tier::kLocal) return local;
  Status remote = impl_->WaitUntilReplicated();
  return !local.ok() ? local : remote;
}
void CheckpointManager::WaitUntilReady() { impl_->WaitUntilReady(); }
Status CheckpointManager::Refresh() { return impl_->RefreshNow(); }
// Reads go to the tier that holds the step (two tiers: ManagerImpl::ReadFromTiers).
Result<RestoredCheckpoint> CheckpointManager::Restore(std::optional<int64_t> step, ProgressFn progress) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) {
    return m.Restore(s, progress);
  });
}
Result<int64_t> CheckpointManager::RestoreInto(std::optional<int64_t> step, std::span<const MutableTensorRef> tensors) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) {
    return m.RestoreInto(s, tensors);
  });
}
Result<int64_t> CheckpointManager::RestoreSlices(std::optional<int64_t> step, std::span<const TensorSlice> slices) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) {
    return m.RestoreSlices(s, slices);
  });
}
std::vector<int64_t> CheckpointManager::AllSteps() const { return impl_->AllStepsAllTiers(); }
std::vector<int64_t> CheckpointManager::AllSteps(Tier tier) const {
  if (tier == Tier::kLocal) return impl_->AllSteps();
  return impl_->remote() != nullptr ? impl_->remote()->AllSteps() : std::vector<int64_t>{};
}
std::optional<int64_t> CheckpointManager::LatestStep() const {
  std::vector<int64_t> all = impl_->AllStepsAllTiers();
  if (all.empty()) return std::nullopt;
  return all.back();
}
Result<CheckpointInfo> CheckpointManager::Info(int64_t step) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) { return m.Info(*s); });
}
Result<VerifyReport> CheckpointManager::Verify(std::optional<int64_t> step, ProgressFn progress) {
  return impl_->ReadFromTiers(step, [&](pipeline::ManagerImpl& m, std::optional<int64_t> s) {
    return m.Verify(s, progress);
  });
}
Status CheckpointManager::Delete(int64_t step) { return impl_->Delete(step); }
Status CheckpointManager::Prune() { return impl_->Prune(); }
const Options& CheckpointManager::options() const { return impl_->options(); }
void CheckpointManager::SetFinalSave(std::function<void(CheckpointManager&)> fn) {
  impl_->SetFinalSave(std::move(fn));
}
bool CheckpointManager::preempted() const { return impl_->preempted(); }
const std::string& CheckpointManager::root() const { return impl_->root(); }
ManagerStats CheckpointManager::stats() const { return impl_->stats(); }
void CheckpointManager::HoldPrefault() { impl_->HoldPrefault(); }
void CheckpointManager::ReleasePrefault() { impl_->ReleasePrefault(); }

}  // namespace ckptio
