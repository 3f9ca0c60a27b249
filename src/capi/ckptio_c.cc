// The C API (include/ckptio/ckptio.h) over CheckpointManager.
//
// Every entry point runs its body through Guard(): the thread's last error is
// cleared, a Status becomes a code plus the thread's message, and any C++
// exception (std::bad_alloc, a BadResultAccess bug, ...) is caught here, so
// none ever unwinds into a C caller.

#include "base/status_macros.h"
#include "ckptio/ckptio.h"

#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "config/config.h"
#include "base/dtype.h"

// The C enums are the C++ ones by value: conversions below are casts.
static_assert(CKPTIO_OK == static_cast<int>(ckptio::StatusCode::kOk));
static_assert(CKPTIO_INVALID_ARGUMENT == static_cast<int>(ckptio::StatusCode::kInvalidArgument));
static_assert(CKPTIO_NOT_FOUND == static_cast<int>(ckptio::StatusCode::kNotFound));
static_assert(CKPTIO_ALREADY_EXISTS == static_cast<int>(ckptio::StatusCode::kAlreadyExists));
static_assert(CKPTIO_FAILED_PRECONDITION == static_cast<int>(ckptio::StatusCode::kFailedPrecondition));
static_assert(CKPTIO_CORRUPTION == static_cast<int>(ckptio::StatusCode::kCorruption));
static_assert(CKPTIO_IO_ERROR == static_cast<int>(ckptio::StatusCode::kIoError));
static_assert(CKPTIO_NO_SPACE == static_cast<int>(ckptio::StatusCode::kNoSpace));
static_assert(CKPTIO_PERMISSION_DENIED == static_cast<int>(ckptio::StatusCode::kPermissionDenied));
static_assert(CKPTIO_UNAVAILABLE == static_cast<int>(ckptio::StatusCode::kUnavailable));
static_assert(CKPTIO_DEADLINE_EXCEEDED == static_cast<int>(ckptio::StatusCode::kDeadlineExceeded));
static_assert(CKPTIO_CANCELLED == static_cast<int>(ckptio::StatusCode::kCancelled));
static_assert(CKPTIO_RESOURCE_EXHAUSTED == static_cast<int>(ckptio::StatusCode::kResourceExhausted));
static_assert(CKPTIO_UNIMPLEMENTED == static_cast<int>(ckptio::StatusCode::kUnimplemented));
static_assert(CKPTIO_INTERNAL == static_cast<int>(ckptio::StatusCode::kInternal));

static_assert(CKPTIO_DTYPE_BOOL == static_cast<int>(ckptio::DType::kBool));
static_assert(CKPTIO_DTYPE_U8 == static_cast<int>(ckptio::DType::kU8));
static_assert(CKPTIO_DTYPE_I8 == static_cast<int>(ckptio::DType::kI8));
static_assert(CKPTIO_DTYPE_U16 == static_cast<int>(ckptio::DType::kU16));
static_assert(CKPTIO_DTYPE_I16 == static_cast<int>(ckptio::DType::kI16));
static_assert(CKPTIO_DTYPE_F16 == static_cast<int>(ckptio::DType::kF16));
static_assert(CKPTIO_DTYPE_BF16 == static_cast<int>(ckptio::DType::kBF16));
static_assert(CKPTIO_DTYPE_U32 == static_cast<int>(ckptio::DType::kU32));
static_assert(CKPTIO_DTYPE_I32 == static_cast<int>(ckptio::DType::kI32));
static_assert(CKPTIO_DTYPE_F32 == static_cast<int>(ckptio::DType::kF32));
static_assert(CKPTIO_DTYPE_U64 == static_cast<int>(ckptio::DType::kU64));
static_assert(CKPTIO_DTYPE_I64 == static_cast<int>(ckptio::DType::kI64));
static_assert(CKPTIO_DTYPE_F64 == static_cast<int>(ckptio::DType::kF64));
static_assert(CKPTIO_DTYPE_F8_E4M3 == static_cast<int>(ckptio::DType::kF8E4M3));
static_assert(CKPTIO_DTYPE_F8_E5M2 == static_cast<int>(ckptio::DType::kF8E5M2));

struct ckptio_manager {
  std::unique_ptr<ckptio::CheckpointManager> impl;
};

struct ckptio_checkpoint {
  ckptio::RestoredCheckpoint restored;
  std::vector<std::vector<uint64_t>> shapes;  // stable copies the C views point into
  std::unordered_map<std::string, size_t> by_name;
};

namespace {

using ckptio::Status;
using ckptio::StatusCode;

thread_local std::string t_last_error;

ckptio_status Fail(const Status& status) {
  t_last_error = status.message();
  return static_cast<ckptio_status>(status.code());
}

// Runs `body` (which returns a Status) with the C API's error contract.
template <typename Body>
ckptio_status Guard(Body&& body) noexcept {
  try {
    t_last_error.clear();
    Status status = body();
    if (!status.ok()) return Fail(status);
    return CKPTIO_OK;
  } catch (const std::bad_alloc&) {
    t_last_error = "out of memory";
    return CKPTIO_RESOURCE_EXHAUSTED;
  } catch (const std::exception& e) {
    t_last_error = std::string("internal error in ckptio: ") + e.what();
    return CKPTIO_INTERNAL;
  } catch (...) {
    t_last_error = "internal error in ckptio: unknown exception";
    return CKPTIO_INTERNAL;
  }
}

Status NullArgument(const char* what) {
  return ckptio::InvalidArgumentError(std::string(what) + " is NULL");
}

std::optional<int64_t> StepArg(int64_t step) {
  if (step == CKPTIO_LATEST_STEP) return std::nullopt;
  return step;
}

// The integer a C caller stored in an enum-typed object. C allows any int
// there, but in C++ loading a value outside the enum's range is undefined
// (UBSan stops on it), so the bytes are read as the underlying type.
template <typename Enum>
int64_t RawEnum(const Enum& value) {
  std::underlying_type_t<Enum> raw;
  std::memcpy(&raw, &value, sizeof raw);
  return static_cast<int64_t>(raw);
}

bool ValidDType(int64_t raw) { return raw >= CKPTIO_DTYPE_BOOL && raw <= CKPTIO_DTYPE_F8_E5M2; }

// REQUIRES: `dtype` is the caller's object (not a copy converted in C++).
Status CheckDType(const ckptio_dtype& dtype, const char* tensor_name) {
  const int64_t raw = RawEnum(dtype);
  if (!ValidDType(raw)) {
    return ckptio::InvalidArgumentError("tensor \"" + std::string(tensor_name) + "\": unknown dtype value " +
                                        std::to_string(raw));
  }
  return Status::Ok();
}

Status CheckShape(size_t ndim, const uint64_t* shape, const char* tensor_name) {
  if (ndim > 0 && shape == nullptr) {
    return ckptio::InvalidArgumentError("tensor \"" + std::string(tensor_name) + "\": shape is NULL but ndim is " +
                                        std::to_string(ndim));
  }
  return Status::Ok();
}

ckptio_status Open(const char* root, const char* config_path, ckptio_manager** out, bool read_only) {
  if (out != nullptr) *out = nullptr;
  return Guard([&]() -> Status {
    if (out == nullptr) return NullArgument("out");
    if (root == nullptr) return NullArgument("root");
    ASSIGN_OR_RETURN(ckptio::Options options,
                     ckptio::config::LoadConfig(config_path == nullptr ? std::string() : std::string(config_path)));
    auto opened = read_only ? ckptio::CheckpointManager::OpenReadOnly(root, std::move(options))
                            : ckptio::CheckpointManager::Open(root, std::move(options));
    RETURN_IF_ERROR(opened);
    *out = new ckptio_manager{std::move(opened).value()};
    return Status::Ok();
  });
}

Status CheckIndex(const ckptio_checkpoint& c, size_t index) {
  if (index < c.restored.tensors.size()) return Status::Ok();
  return ckptio::InvalidArgumentError("tensor index " + std::to_string(index) + " out of range: the checkpoint has " +
                                      std::to_string(c.restored.tensors.size()) + " tensors");
}

void FillView(const ckptio_checkpoint& c, size_t index, ckptio_tensor* out) {
  const ckptio::Tensor& t = c.restored.tensors[index];
  out->name = t.name.c_str();
  out->dtype = static_cast<ckptio_dtype>(t.dtype);
  out->ndim = c.shapes[index].size();
  out->shape = c.shapes[index].empty() ? nullptr : c.shapes[index].data();
  out->data = t.bytes.empty() ? nullptr : t.bytes.data();
}

}  // namespace

extern "C" {

const char* ckptio_version(void) { return CKPTIO_VERSION; }

const char* ckptio_status_name(ckptio_status status) {
  const int64_t raw = RawEnum(status);
  if (raw < CKPTIO_OK || raw > CKPTIO_INTERNAL) return "Unknown";
  return ckptio::StatusCodeName(static_cast<StatusCode>(raw));
}

const char* ckptio_last_error(void) { return t_last_error.c_str(); }

ckptio_status ckptio_open(const char* root, const char* config_path, ckptio_manager** out) {
  return Open(root, config_path, out, /*read_only=*/false);
}

ckptio_status ckptio_open_read_only(const char* root, const char* config_path, ckptio_manager** out) {
  return Open(root, config_path, out, /*read_only=*/true);
}

void ckptio_close(ckptio_manager* manager) {
  // The destructor waits for saves in flight and does not throw; the guard
  // keeps a bug from unwinding into C all the same.
  (void)Guard([&]() -> Status {
    delete manager;
    return Status::Ok();
  });
}

ckptio_status ckptio_save(ckptio_manager* manager, int64_t step, const ckptio_tensor* tensors, size_t count,
                          const char* metadata_json) {
  return ckptio_save_chunks(manager, step, tensors, nullptr, count, metadata_json);
}

ckptio_status ckptio_save_chunks(ckptio_manager* manager, int64_t step, const ckptio_tensor* tensors,
                                 const ckptio_chunk* chunks, size_t count, const char* metadata_json) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    if (tensors == nullptr && count > 0) return NullArgument("tensors");
    std::vector<ckptio::TensorRef> refs;
    refs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      const ckptio_tensor& t = tensors[i];
      const bool chunk = chunks != nullptr && chunks[i].array != nullptr;
      if (t.name == nullptr && !chunk) {
        return ckptio::InvalidArgumentError("tensor " + std::to_string(i) + ": name is NULL");
      }
      const std::string name = t.name != nullptr ? t.name : "chunk " + std::to_string(i) + " of " + chunks[i].array;
      RETURN_IF_ERROR(CheckDType(t.dtype, name.c_str()));
      RETURN_IF_ERROR(CheckShape(t.ndim, t.shape, name.c_str()));
      ckptio::TensorRef ref{t.name != nullptr ? t.name : "", static_cast<ckptio::DType>(t.dtype),
                            std::vector<uint64_t>(t.shape, t.shape + t.ndim), t.data};
      if (chunk) {
        const ckptio_chunk& c = chunks[i];
        if (c.ndim != t.ndim) {
          return ckptio::InvalidArgumentError("tensor \"" + name + "\": its chunk has " + std::to_string(c.ndim) +
                                              " axes, the tensor " + std::to_string(t.ndim));
        }
        if (c.ndim > 0 && (c.global_shape == nullptr || c.start == nullptr)) {
          return ckptio::InvalidArgumentError("tensor \"" + name + "\": its chunk's global_shape or start is NULL");
        }
        ref.chunk = {c.array, std::vector<uint64_t>(c.global_shape, c.global_shape + c.ndim),
                     std::vector<uint64_t>(c.start, c.start + c.ndim)};
      }
      refs.push_back(std::move(ref));
    }
    auto handle = manager->impl->Save(step, refs, metadata_json == nullptr ? "{}" : metadata_json);
    return handle.status();
  });
}

ckptio_status ckptio_wait(ckptio_manager* manager) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    return manager->impl->WaitUntilFinished();
  });
}

ckptio_status ckptio_wait_snapshots(ckptio_manager* manager) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    manager->impl->WaitSnapshots();
    return Status::Ok();
  });
}

ckptio_status ckptio_latest_step(ckptio_manager* manager, int64_t* step) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    if (step == nullptr) return NullArgument("step");
    std::optional<int64_t> latest = manager->impl->LatestStep();
    if (!latest) return ckptio::NotFoundError("no committed checkpoint in " + manager->impl->root());
    *step = *latest;
    return Status::Ok();
  });
}

ckptio_status ckptio_all_steps(ckptio_manager* manager, int64_t* steps, size_t capacity, size_t* count) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    if (count == nullptr) return NullArgument("count");
    if (steps == nullptr && capacity > 0) return NullArgument("steps");
    std::vector<int64_t> all = manager->impl->AllSteps();
    for (size_t i = 0; i < all.size() && i < capacity; ++i) steps[i] = all[i];
    *count = all.size();
    return Status::Ok();
  });
}

ckptio_status ckptio_refresh(ckptio_manager* manager) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    return manager->impl->Refresh();
  });
}

ckptio_status ckptio_delete(ckptio_manager* manager, int64_t step) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    return manager->impl->Delete(step);
  });
}

ckptio_status ckptio_restore(ckptio_manager* manager, int64_t step, ckptio_checkpoint** out) {
  if (out != nullptr) *out = nullptr;
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    if (out == nullptr) return NullArgument("out");
    ASSIGN_OR_RETURN(ckptio::RestoredCheckpoint restored, manager->impl->Restore(StepArg(step)));
    auto checkpoint = std::make_unique<ckptio_checkpoint>();
    checkpoint->restored = std::move(restored);
    const auto& tensors = checkpoint->restored.tensors;
    checkpoint->shapes.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      checkpoint->shapes.push_back(tensors[i].shape);
      checkpoint->by_name.emplace(tensors[i].name, i);
    }
    if (checkpoint->restored.metadata_json.empty()) checkpoint->restored.metadata_json = "{}";
    *out = checkpoint.release();
    return Status::Ok();
  });
}

ckptio_status ckptio_restore_into(ckptio_manager* manager, int64_t step, const ckptio_mutable_tensor* tensors,
                                  size_t count, int64_t* step_read) {
  return Guard([&]() -> Status {
    if (manager == nullptr) return NullArgument("manager");
    if (tensors == nullptr && count > 0) return NullArgument("tensors");
    std::vector<ckptio::MutableTensorRef> refs;
    refs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      const ckptio_mutable_tensor& t = tensors[i];
      if (t.name == nullptr) return ckptio::InvalidArgumentError("tensor " + std::to_string(i) + ": name is NULL");
      RETURN_IF_ERROR(CheckDType(t.dtype, t.name));
      RETURN_IF_ERROR(CheckShape(t.ndim, t.shape, t.name));
      refs.push_back({t.name, static_cast<ckptio::DType>(t.dtype),
                      std::vector<uint64_t>(t.shape, t.shape + t.ndim), t.data});
    }
    ASSIGN_OR_RETURN(int64_t read, manager->impl->RestoreInto(StepArg(step), refs));
    if (step_read != nullptr) *step_read = read;
    return Status::Ok();
  });
}

int64_t ckptio_checkpoint_step(const ckptio_checkpoint* checkpoint) {
  return checkpoint == nullptr ? -1 : checkpoint->restored.step;
}

const char* ckptio_checkpoint_metadata(const ckptio_checkpoint* checkpoint) {
  return checkpoint == nullptr ? "{}" : checkpoint->restored.metadata_json.c_str();
}

size_t ckptio_checkpoint_tensor_count(const ckptio_checkpoint* checkpoint) {
  return checkpoint == nullptr ? 0 : checkpoint->restored.tensors.size();
}

ckptio_status ckptio_checkpoint_tensor(const ckptio_checkpoint* checkpoint, size_t index, ckptio_tensor* out) {
  return Guard([&]() -> Status {
    if (checkpoint == nullptr) return NullArgument("checkpoint");
    if (out == nullptr) return NullArgument("out");
    RETURN_IF_ERROR(CheckIndex(*checkpoint, index));
    FillView(*checkpoint, index, out);
    return Status::Ok();
  });
}

ckptio_status ckptio_checkpoint_find(const ckptio_checkpoint* checkpoint, const char* name, ckptio_tensor* out) {
  return Guard([&]() -> Status {
    if (checkpoint == nullptr) return NullArgument("checkpoint");
    if (name == nullptr) return NullArgument("name");
    if (out == nullptr) return NullArgument("out");
    auto it = checkpoint->by_name.find(name);
    if (it == checkpoint->by_name.end()) {
      return ckptio::NotFoundError("no tensor \"" + std::string(name) + "\" in checkpoint step " +
                                   std::to_string(checkpoint->restored.step));
    }
    FillView(*checkpoint, it->second, out);
    return Status::Ok();
  });
}

ckptio_status ckptio_checkpoint_chunk(const ckptio_checkpoint* checkpoint, size_t index, ckptio_chunk* out) {
  return Guard([&]() -> Status {
    if (checkpoint == nullptr) return NullArgument("checkpoint");
    if (out == nullptr) return NullArgument("out");
    RETURN_IF_ERROR(CheckIndex(*checkpoint, index));
    const ckptio::ChunkOf& c = checkpoint->restored.tensors[index].chunk;
    *out = {};
    if (c.empty()) return Status::Ok();
    out->array = c.array.c_str();
    out->ndim = c.start.size();
    out->global_shape = c.global_shape.empty() ? nullptr : c.global_shape.data();
    out->start = c.start.empty() ? nullptr : c.start.data();
    return Status::Ok();
  });
}

void ckptio_checkpoint_free(ckptio_checkpoint* checkpoint) { delete checkpoint; }

size_t ckptio_dtype_size(ckptio_dtype dtype) {
  const int64_t raw = RawEnum(dtype);
  if (!ValidDType(raw)) return 0;
  return ckptio::base::DTypeSize(static_cast<ckptio::DType>(raw));
}

}  // extern "C"
