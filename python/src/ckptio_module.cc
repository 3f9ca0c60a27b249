// ckptio._ckptio: the CPython binding of CheckpointManager (pybind11).
//
// It takes and returns flat lists of (name, dtype, numpy array); the pure
// Python package (python/ckptio/__init__.py) turns pytrees into those lists
// and back, and maps dtypes through numpy and ml_dtypes.
//
// Contracts kept here:
//  - No copy: Save() reads the numpy buffers in place (the snapshot is
//    ckptio's own copy into staging); restored tensors become numpy arrays
//    that own ckptio's buffers (a capsule), without a copy.
//  - The GIL is released around everything that can take long: Open (locks,
//    listings, staging), Save (the snapshot copy, or backpressure), waits,
//    Restore, Verify, Delete. The caller's arrays stay referenced by the
//    caller's lists for the whole call, so releasing the GIL is safe.
//  - A save holds a reference to its arrays until nothing reads them (right
//    after the copy, or once written with snapshot "borrow"): a temporary
//    the package made, or a state the trainer rebinds, stays alive as long
//    as ckptio reads it (HeldObjects).
//  - Waits run in slices: PyErr_CheckSignals() between slices, so Ctrl-C
//    raises KeyboardInterrupt at once while the save carries on in the
//    background (the manager's WaitUntilFinished runs on a helper thread; a
//    later wait picks up the same pending result, so no error is lost).
//  - A failed Status becomes the Python exception class the package
//    registered for its code (_set_error_factory), carrying the C++ message.
//  - Threads ckptio starts are created with SIGINT/SIGTERM/... blocked, so
//    signals are delivered to Python's threads, never to an io_uring loop.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "config/config.h"
#include "config/knobs.h"
#include "base/dtype.h"
#include "storage/open_storage.h"

namespace py = pybind11;

namespace ckptio::python {
namespace {

using namespace std::chrono_literals;

// A failed Status on its way to Python (see the translator in the module init).
struct StatusError {
  Status status;
};

void Check(const Status& s) {
  if (!s.ok()) throw StatusError{s};
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) throw StatusError{std::move(r).status()};
  return std::move(r).value();
}

// ckptio._errors.make_error(code_name, message) -> exception instance.
// Set once at import and kept for the life of the process (never decref'd:
// it must outlive every exception translation, including at shutdown).
PyObject* g_error_factory = nullptr;

void SetError(const Status& s) {
  const std::string& message = s.message().empty() ? s.ToString() : s.message();
  if (g_error_factory == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, s.ToString().c_str());
    return;
  }
  // "replace": a path in a message need not be valid UTF-8.
  PyObject* text = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
  if (text == nullptr) return;
  PyObject* exc = PyObject_CallFunction(g_error_factory, "sO", StatusCodeName(s.code()), text);
  Py_DECREF(text);
  if (exc == nullptr) return;  // the factory's own error is set
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
}

// Blocks the asynchronous signals in this thread while alive, so threads it
// starts inherit a mask that sends those signals elsewhere (to Python).
class SignalsBlocked {
 public:
  SignalsBlocked() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGCHLD, SIGWINCH}) {
      sigaddset(&set, sig);
    }
    pthread_sigmask(SIG_BLOCK, &set, &old_);
  }
  ~SignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  SignalsBlocked(const SignalsBlocked&) = delete;
  SignalsBlocked& operator=(const SignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

// Python objects a save holds while ckptio reads their memory (the arrays of
// a borrow-mode save, or a temporary contiguous copy the package made). The
// manager drops its reference on a ckptio thread, which may not touch
// Python: the object is queued here and released by the interpreter's main
// thread at its next chance (Py_AddPendingCall), or by the next call into
// ckptio, whichever comes first.
class HeldObjects {
 public:
  // A keep_alive for CheckpointManager::Save that owns a reference to `obj`.
  // REQUIRES: the GIL is held.
  static std::shared_ptr<const void> Hold(const py::handle& obj) {
    PyObject* raw = obj.ptr();
    Py_INCREF(raw);
    return std::shared_ptr<const void>(raw, [](const void* p) { Release(static_cast<const PyObject*>(p)); });
  }

  // Drops every reference queued so far. REQUIRES: the GIL is held.
  static void Drain() {
    std::vector<PyObject*> done;
    {
      std::lock_guard lock(mu());
      done.swap(queue());
      scheduled() = false;
    }
    for (PyObject* o : done) Py_DECREF(o);
  }

 private:
  static void Release(const PyObject* p) {
    if (Py_IsInitialized() == 0) return;  // at exit: the interpreter is gone, leak it
    bool schedule = false;
    {
      std::lock_guard lock(mu());
      queue().push_back(const_cast<PyObject*>(p));
      schedule = !std::exchange(scheduled(), true);
    }
    // Safe without the GIL. If the queue of pending calls is full, the next
    // call into ckptio drains instead.
    if (schedule && Py_AddPendingCall(&DrainPending, nullptr) != 0) {
      std::lock_guard lock(mu());
      scheduled() = false;
    }
  }
  static int DrainPending(void*) {
    Drain();
    return 0;
  }
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<PyObject*>& queue() {
    static auto* q = new std::vector<PyObject*>();  // never destroyed: used at exit
    return *q;
  }
  static bool& scheduled() {
    static bool s = false;
    return s;
  }
};

// Calls `done()` (with the GIL released) until it returns true, waking every
// `slice` to let Python run its signal handlers: a KeyboardInterrupt (or any
// exception a handler raises) propagates as py::error_already_set.
// REQUIRES: the GIL is held.
template <typename DoneFn>
void WaitInSlices(DoneFn&& done_within) {
  for (;;) {
    bool done;
    {
      py::gil_scoped_release release;
      done = done_within(50ms);
    }
    HeldObjects::Drain();  // buffers of saves that ended meanwhile go now, not after the wait
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// The outcome of one WaitUntilFinished() run on a helper thread.
struct PendingWait {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;

  bool WaitFor(std::chrono::milliseconds d) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, d, [this] { return done; });
  }
  void Finish(Status s) {
    {
      std::lock_guard lock(mu);
      status = std::move(s);
      done = true;
    }
    cv.notify_all();
  }
};

// A Python callable as a ckptio Barrier: `fn(name)` must return once every
// process has called it with the same name (e.g. jax.experimental.
// multihost_utils.sync_global_devices). ckptio calls it on its barrier thread,
// which takes the GIL for the call; every method that can wait for a barrier
// (save's backpressure, waits, close) releases the GIL, so it cannot deadlock
// on the trainer's thread. The timeout cannot interrupt a Python call: the
// callable's own timeout applies.
class PythonBarrier {
 public:
  explicit PythonBarrier(py::object fn) : fn_(new py::object(std::move(fn))) {}
  // The last reference may go on a ckptio thread: take the GIL to drop it.
  ~PythonBarrier() {
    if (Py_IsInitialized() == 0) return;  // at exit: leaked, the interpreter is gone
    py::gil_scoped_acquire gil;
    delete fn_;
  }
  PythonBarrier(const PythonBarrier&) = delete;
  PythonBarrier& operator=(const PythonBarrier&) = delete;

  Status Wait(const std::string& name) {
    if (Py_IsInitialized() == 0) return CancelledError("barrier \"" + name + "\": the interpreter is exiting");
    py::gil_scoped_acquire gil;
    try {
      (*fn_)(name);
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return UnavailableError("barrier \"" + name + "\": the barrier callable raised " + e.what());
    }
  }

  // As an all-gather: `fn(name, data)` returns every process's bytes.
  Result<std::vector<std::string>> AllGather(const std::string& name, const std::string& bytes) {
    const std::string what = "all-gather \"" + name + "\"";
    if (Py_IsInitialized() == 0) return CancelledError(what + ": the interpreter is exiting");
    py::gil_scoped_acquire gil;
    try {
      py::object got = (*fn_)(name, py::bytes(bytes));
      std::vector<std::string> out;
      for (py::handle part : got) out.push_back(py::cast<std::string>(py::bytes(py::reinterpret_borrow<py::object>(part))));
      return out;
    } catch (py::error_already_set& e) {
      return UnavailableError(what + ": the allgather callable raised " + e.what());
    } catch (const py::cast_error& e) {
      return InvalidArgumentError(what + ": the allgather callable must return a list of bytes (" + e.what() + ")");
    }
  }

 private:
  py::object* fn_;
};

std::shared_ptr<Barrier> MakeBarrier(const py::object& fn, const py::object& allgather_fn) {
  if (fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) Check(InvalidArgumentError("barrier must be callable (barrier(name))"));
  auto barrier = std::make_shared<PythonBarrier>(fn);
  AllGatherFn all_gather;
  if (!allgather_fn.is_none()) {
    if (!PyCallable_Check(allgather_fn.ptr())) {
      Check(InvalidArgumentError("allgather must be callable (allgather(name, data) -> list of bytes)"));
    }
    auto gather = std::make_shared<PythonBarrier>(allgather_fn);
    all_gather = [gather](const std::string& name, std::string bytes, std::chrono::milliseconds) {
      return gather->AllGather(name, bytes);
    };
  }
  return CallbackBarrier([barrier](const std::string& name, std::chrono::milliseconds) { return barrier->Wait(name); },
                         std::move(all_gather));
}

py::dict TimingsDict(const SaveTimings& t) {
  py::dict d;
  d["snapshot_seconds"] = t.snapshot_seconds;
  d["persist_seconds"] = t.persist_seconds;
  d["bytes"] = t.bytes;
  return d;
}

// What save() returns: the save of one step, running in the background.
class PySaveHandle {
 public:
  explicit PySaveHandle(SaveHandle h) : handle_(std::move(h)) {}

  int64_t step() const { return handle_.step(); }
  bool skipped() const { return handle_.skipped(); }
  bool done() const { return handle_.done(); }
  uint64_t bytes_written() const { return handle_.bytes_written(); }
  py::dict timings() const { return TimingsDict(handle_.timings()); }

  // Until the copy is taken (snapshot "background"; at once in "copy" mode);
  // raises the snapshot check's error. The GIL is released: the check takes it.
  void WaitSnapshot() const {
    Status s;
    {
      py::gil_scoped_release release;
      s = handle_.WaitSnapshot();
    }
    HeldObjects::Drain();
    Check(s);
  }

  // Blocks until the save has ended (interruptible); raises its error.
  void Wait() const {
    WaitInSlices([this](std::chrono::milliseconds slice) {
      // SaveHandle has no timed wait; a done() poll every millisecond or so
      // costs nothing next to a save.
      const auto until = std::chrono::steady_clock::now() + slice;
      while (!handle_.done()) {
        if (std::chrono::steady_clock::now() >= until) return false;
        std::this_thread::sleep_for(1ms);
      }
      return true;
    });
    Check(handle_.Wait());
  }

  // None while running; then None on success, or the exception instance.
  py::object Error() const {
    std::optional<Status> s = handle_.status();
    if (!s || s->ok()) return py::none();
    SetError(*s);
    py::error_already_set e;  // fetches (and clears) the error just set
    return e.value();
  }

 private:
  SaveHandle handle_;
};

// A Python callable as a save's SnapshotCheck: `fn()` runs on the thread
// that took the copy (the snapshot thread in background mode), with the GIL;
// an exception it raises fails the save, with its message.
class PythonSnapshotCheck {
 public:
  explicit PythonSnapshotCheck(py::object fn) : fn_(new py::object(std::move(fn))) {}
  ~PythonSnapshotCheck() {
    if (Py_IsInitialized() == 0) return;  // at exit: leaked, the interpreter is gone
    py::gil_scoped_acquire gil;
    delete fn_;
  }
  PythonSnapshotCheck(const PythonSnapshotCheck&) = delete;
  PythonSnapshotCheck& operator=(const PythonSnapshotCheck&) = delete;

  Status operator()() {
    if (Py_IsInitialized() == 0) return CancelledError("snapshot check: the interpreter is exiting");
    py::gil_scoped_acquire gil;
    try {
      (*fn_)();
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return FailedPreconditionError(py::str(e.value()).cast<std::string>());
    }
  }

 private:
  py::object* fn_;
};

// One CheckpointManager, as the Python class _ckptio.Manager.
class PyManager {
 public:
  PyManager(std::string root, const std::string& config_path,
            const std::vector<std::pair<std::string, std::string>>& overrides, bool read_only,
            const py::object& barrier_fn, const py::object& allgather_fn) {
    Options options = Take(config::LoadConfig(config_path));
    for (const auto& [path, json_text] : overrides) ApplyOverride(path, json_text, options);
    if (Status s = config::ValidateOptions(options); !s.ok()) {
      Check(InvalidArgumentError("invalid options: " + s.message()));
    }
    std::shared_ptr<Barrier> barrier = MakeBarrier(barrier_fn, allgather_fn);
    Result<std::unique_ptr<CheckpointManager>> opened = [&] {
      py::gil_scoped_release release;
      SignalsBlocked blocked;  // the loop, pool and barrier threads inherit the mask
      return read_only ? CheckpointManager::OpenReadOnly(std::move(root), std::move(options))
                       : CheckpointManager::Open(std::move(root), std::move(options), std::move(barrier));
    }();
    mgr_ = Take(std::move(opened));
    root_ = mgr_->root();
    read_only_ = read_only;
  }

  // Waits for saves in flight (a manager going away must not tear them),
  // unless abandon() said the process is exiting without waiting.
  ~PyManager() {
    std::shared_ptr<CheckpointManager> m = std::move(mgr_);
    std::thread waiter = std::move(waiter_);
    if (abandoned_) {
      // Leaked on purpose: the process is exiting on the user's request;
      // saves in flight are cut short like a crash, which leaves the newest
      // committed checkpoint intact (the commit protocol is crash-safe).
      new std::shared_ptr<CheckpointManager>(std::move(m));
      if (waiter.joinable()) waiter.detach();
      return;
    }
    auto finish = [&] {
      if (waiter.joinable()) waiter.join();
      m.reset();
    };
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      finish();
    } else {
      finish();
    }
  }

  PyManager(const PyManager&) = delete;
  PyManager& operator=(const PyManager&) = delete;

  // `chunks`: None, or one entry per tensor: None (a whole tensor) or
  // (array name, global shape, start) for a chunk of a sharded array.
  // `local`: None, or one bool per tensor: TensorRef::local_copy.
  py::object Save(int64_t step, const py::list& names, const py::list& dtypes, const py::list& arrays,
                  const std::string& metadata_json, const py::object& chunks, bool borrow, const py::object& local,
                  const py::object& check) {
    auto m = Get();
    HeldObjects::Drain();
    TakeUncollectedWaitError();
    const size_t n = py::len(names);
    if (py::len(dtypes) != n || py::len(arrays) != n) {
      Check(InvalidArgumentError("save: names, dtypes and arrays differ in length"));
    }
    std::vector<TensorRef> refs;
    refs.reserve(n);
    if (!chunks.is_none() && py::len(chunks) != n) {
      Check(InvalidArgumentError("save: names and chunks differ in length"));
    }
    if (!local.is_none() && py::len(local) != n) Check(InvalidArgumentError("save: names and local differ in length"));
    for (size_t i = 0; i < n; ++i) {
      ChunkOf chunk;
      if (!chunks.is_none() && !chunks[py::int_(i)].is_none()) {
        auto [array, global_shape, start] =
            py::cast<std::tuple<std::string, std::vector<uint64_t>, std::vector<uint64_t>>>(chunks[py::int_(i)]);
        chunk = {std::move(array), std::move(global_shape), std::move(start)};
      }
      // A chunk named "" is named by the library (ChunkName).
      auto name = py::cast<std::string>(names[i]);
      if (name.empty() && !chunk.empty()) name = ChunkName(chunk.array, chunk.start);
      refs.push_back(Ref(std::move(name), dtypes[i], arrays[i]));
      refs.back().chunk = std::move(chunk);
      refs.back().local_copy = !local.is_none() && py::cast<bool>(local[py::int_(i)]);
    }
    // The manager holds the arrays (the caller's, or copies the package made
    // contiguous) until nothing reads them: the caller may drop its own
    // references as soon as save() returns, in borrow mode too.
    std::shared_ptr<const void> keep_alive = HeldObjects::Hold(arrays);
    SnapshotCheck snapshot_check;
    if (!check.is_none()) {
      auto fn = std::make_shared<PythonSnapshotCheck>(check);
      snapshot_check = [fn] { return (*fn)(); };
    }
    Result<SaveHandle> handle = [&] {
      py::gil_scoped_release release;
      return m->Save(step, refs, metadata_json, std::move(keep_alive),
                     borrow ? std::optional<SnapshotMode>(SnapshotMode::kBorrow) : std::nullopt,
                     std::move(snapshot_check));
    }();
    HeldObjects::Drain();  // a copy-mode save let go of them already
    return py::cast(PySaveHandle(Take(std::move(handle))));
  }

  // Blocks until no save is in flight (interruptible); raises the first
  // background failure not reported yet.
  void WaitUntilFinished() {
    std::shared_ptr<PendingWait> pending = StartWait();
    WaitInSlices([&](std::chrono::milliseconds slice) { return pending->WaitFor(slice); });
    CollectWait(pending);
    Check(pending->status);
  }

  // Waits (interruptible), then releases the manager: its lock, its staging
  // memory and its threads; later calls raise. A background failure is
  // raised after the release; a KeyboardInterrupt leaves the manager open.
  void Close() {
    if (!Peek()) return;
    std::optional<Status> failure;
    try {
      WaitUntilFinished();
    } catch (const StatusError& e) {
      failure = e.status;
    }
    std::shared_ptr<CheckpointManager> m;
    std::thread waiter;
    {
      std::lock_guard lock(mu_);
      m = std::move(mgr_);
      waiter = std::move(waiter_);
    }
    {
      py::gil_scoped_release release;
      if (waiter.joinable()) waiter.join();
      m.reset();
    }
    if (failure) Check(*failure);
  }

  void Abandon() {
    std::lock_guard lock(mu_);
    abandoned_ = true;
  }

  // (step, metadata_json, [(name, array), ...])
  py::tuple Restore(std::optional<int64_t> step, const py::dict& numpy_dtypes) {
    auto m = Get();
    Result<RestoredCheckpoint> restored = [&] {
      py::gil_scoped_release release;
      return m->Restore(step);
    }();
    RestoredCheckpoint rc = Take(std::move(restored));
    py::list tensors;
    for (Tensor& t : rc.tensors) {
      py::str dtype_name(std::string(base::DTypeName(t.dtype)));
      if (!numpy_dtypes.contains(dtype_name)) {
        Check(UnimplementedError("tensor \"" + t.name + "\": no numpy dtype for " + std::string(dtype_name)));
      }
      py::dtype dt = py::dtype::from_args(numpy_dtypes[dtype_name]);
      std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
      auto owner = std::make_unique<Bytes>(std::move(t.bytes));
      const void* data = owner->empty() ? nullptr : owner->data();
      py::capsule base(owner.get(), [](void* p) { delete static_cast<Bytes*>(p); });
      owner.release();  // the capsule owns it now
      tensors.append(py::make_tuple(t.name, py::array(dt, shape, data, data ? py::handle(base) : py::handle())));
    }
    return py::make_tuple(rc.step, rc.metadata_json, tensors);
  }

  // (metadata json, [(name, dtype name, shape, None or (array, global
  // shape, start)), ...]) of checkpoint `step`, as its manifest lists them.
  py::tuple Tensors(int64_t step) {
    CheckpointInfo i = ReadInfo(step);
    py::list out;
    for (const TensorInfo& t : i.tensor_list) {
      py::object chunk = py::none();
      if (!t.chunk.empty()) {
        chunk = py::make_tuple(t.chunk.array, py::tuple(py::cast(t.chunk.global_shape)), py::tuple(py::cast(t.chunk.start)));
      }
      out.append(py::make_tuple(t.name, std::string(base::DTypeName(t.dtype)), py::tuple(py::cast(t.shape)), chunk));
    }
    return py::make_tuple(i.metadata_json, out);
  }

  // Reads byte ranges of named tensors of checkpoint `step` into writable
  // buffers: [(name, byte offset into the tensor, buffer), ...]; the length
  // read is each buffer's size. Or (name, offset, buffer, length, rows,
  // stride, dst_stride): `rows` ranges of `length` bytes, row i from offset +
  // i * stride to the buffer's byte i * dst_stride (TensorSlice). Returns the
  // step read.
  int64_t RestoreSlices(std::optional<int64_t> step, const py::list& slices) {
    auto m = Get();
    std::vector<TensorSlice> refs;
    refs.reserve(py::len(slices));
    for (py::handle item : slices) {
      auto slice = py::cast<py::tuple>(item);
      if (slice.size() != 3 && slice.size() != 7) {
        Check(InvalidArgumentError("restore_slices: each slice is (name, offset, buffer) or (name, offset, buffer, "
                                   "length, rows, stride, dst_stride)"));
      }
      auto name = py::cast<std::string>(slice[0]);
      if (!py::isinstance<py::array>(slice[2])) Check(InvalidArgumentError("restore_slices: tensor \"" + name + "\": the buffer is not a numpy array"));
      auto buffer = py::reinterpret_borrow<py::array>(slice[2]);
      if ((buffer.flags() & py::array::c_style) == 0 || !buffer.writeable()) {
        Check(InvalidArgumentError("restore_slices: tensor \"" + name + "\": the buffer is not a writable C-contiguous array"));
      }
      TensorSlice ref{std::move(name), py::cast<uint64_t>(slice[1]), static_cast<uint64_t>(buffer.nbytes()),
                      buffer.mutable_data()};
      if (slice.size() == 7) {
        ref.length = py::cast<uint64_t>(slice[3]);
        ref.rows = py::cast<uint64_t>(slice[4]);
        ref.stride = py::cast<uint64_t>(slice[5]);
        ref.dst_stride = py::cast<uint64_t>(slice[6]);
        // The rows must land inside the buffer: (rows - 1) * dst_stride + length.
        const uint64_t nbytes = static_cast<uint64_t>(buffer.nbytes());
        const bool inside = ref.rows == 0 || ref.length == 0 ||
                            (ref.length <= nbytes && (ref.rows == 1 || (ref.dst_stride > 0 &&
                             ref.rows - 1 <= (nbytes - ref.length) / ref.dst_stride)));
        if (!inside) {
          Check(InvalidArgumentError("restore_slices: tensor \"" + ref.name + "\": " + std::to_string(ref.rows) +
                                     " rows of " + std::to_string(ref.length) + " bytes at dst_stride " +
                                     std::to_string(ref.dst_stride) + " do not fit the buffer of " +
                                     std::to_string(nbytes) + " bytes"));
        }
      }
      refs.push_back(std::move(ref));
    }
    Result<int64_t> read = [&] {
      py::gil_scoped_release release;
      return m->RestoreSlices(step, refs);
    }();
    return Take(std::move(read));
  }

  std::vector<int64_t> AllSteps() { return Get()->AllSteps(); }
  std::vector<int64_t> TierSteps(bool remote) {
    return Get()->AllSteps(remote ? CheckpointManager::Tier::kRemote : CheckpointManager::Tier::kLocal);
  }
  std::optional<int64_t> LatestStep() { return Get()->LatestStep(); }

  void Refresh() {
    auto m = Get();
    py::gil_scoped_release release;
    Check(m->Refresh());
  }

  void Delete(int64_t step) {
    auto m = Get();
    Status s;
    {
      py::gil_scoped_release release;
      s = m->Delete(step);
    }
    Check(s);
  }

  py::dict Info(int64_t step) {
    CheckpointInfo i = ReadInfo(step);
    py::dict d;
    d["step"] = i.step;
    d["created"] = i.created;
    d["bytes"] = i.bytes;
    d["tensors"] = i.tensors;
    d["shards"] = i.shards;
    d["bytes_in_earlier"] = i.bytes_in_earlier;
    d["metadata_json"] = i.metadata_json;
    return d;
  }

  py::dict Verify(std::optional<int64_t> step) {
    auto m = Get();
    Result<VerifyReport> report = [&] {
      py::gil_scoped_release release;
      return m->Verify(step);
    }();
    VerifyReport r = Take(std::move(report));
    py::dict d;
    d["step"] = r.step;
    d["bytes_read"] = r.bytes_read;
    d["tensors"] = r.tensors;
    d["shards"] = r.shards;
    return d;
  }

  void HoldPrefault() { Get()->HoldPrefault(); }
  void ReleasePrefault() { Get()->ReleasePrefault(); }
  void WaitUntilReady() {
    std::shared_ptr<CheckpointManager> m = Get();
    py::gil_scoped_release release;
    m->WaitUntilReady();
  }

  // Until every admitted save's copy is taken (snapshot "background"). The
  // GIL is released: a save's snapshot check takes it.
  void WaitSnapshots() {
    std::shared_ptr<CheckpointManager> m = Get();
    {
      py::gil_scoped_release release;
      m->WaitSnapshots();
    }
    HeldObjects::Drain();
  }

  py::dict Stats() {
    ManagerStats s = Get()->stats();
    py::dict d;
    d["saves_committed"] = s.saves_committed;
    d["saves_failed"] = s.saves_failed;
    d["saves_skipped"] = s.saves_skipped;
    d["bytes_committed"] = s.bytes_committed;
    d["bytes_reused"] = s.bytes_reused;
    d["checkpoints_pruned"] = s.checkpoints_pruned;
    d["storage_retries"] = s.storage_retries;
    d["steps_replicated"] = s.steps_replicated;
    d["replications_failed"] = s.replications_failed;
    d["replications_skipped"] = s.replications_skipped;
    d["bytes_resumed"] = s.bytes_resumed;
    d["steps_seeded"] = s.steps_seeded;
    d["bytes_read_remote"] = s.bytes_read_remote;
    d["staging_resident_bytes"] = s.staging_resident_bytes;
    return d;
  }

  // Two tiers: blocks until the saves and their copies to the remote tier
  // are done; raises their failures.
  void WaitUntilReplicated() {
    WaitUntilFinished();
    std::shared_ptr<CheckpointManager> m = Get();
    Status s;
    {
      py::gil_scoped_release release;
      s = m->WaitUntilFinished(CheckpointManager::Tier::kRemote);
    }
    Check(s);
  }

  std::string OptionsJson() { return config::ToJson(Get()->options()); }
  const std::string& root() const { return root_; }
  bool read_only() const { return read_only_; }
  bool closed() { return !Peek(); }

 private:
  static void ApplyOverride(const std::string& path, const std::string& json_text, Options& options) {
    const config::Knob* knob = config::FindKnob(path);
    if (knob == nullptr || knob->is_group()) {
      Check(InvalidArgumentError("unknown option \"" + path + "\" (`ckptio config defaults` lists them)"));
    }
    nlohmann::ordered_json value = nlohmann::ordered_json::parse(json_text, nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) Check(InvalidArgumentError("option \"" + path + "\": not JSON: " + json_text));
    if (Status s = config::ParseKnob(*knob, value, options); !s.ok()) {
      Check(InvalidArgumentError("option \"" + path + "\": " + s.message()));
    }
  }

  // The manifest's view of `step` (the GIL released while it is read).
  CheckpointInfo ReadInfo(int64_t step) {
    auto m = Get();
    Result<CheckpointInfo> info = [&] {
      py::gil_scoped_release release;
      return m->Info(step);
    }();
    return Take(std::move(info));
  }

  // One tensor of a save: the array must be C-contiguous (the package made
  // it so) and its itemsize must be the dtype's.
  static TensorRef Ref(std::string name, py::handle dtype, py::handle obj) {
    TensorRef ref;
    ref.name = std::move(name);
    ref.dtype = Take(base::ParseDType(py::cast<std::string>(dtype)));
    if (!py::isinstance<py::array>(obj)) {
      Check(InvalidArgumentError("tensor \"" + ref.name + "\": not a numpy array"));
    }
    auto array = py::reinterpret_borrow<py::array>(obj);
    if ((array.flags() & py::array::c_style) == 0) {
      Check(InvalidArgumentError("tensor \"" + ref.name + "\": not C-contiguous"));
    }
    if (static_cast<size_t>(array.itemsize()) != base::DTypeSize(ref.dtype)) {
      Check(InvalidArgumentError("tensor \"" + ref.name + "\": " + std::to_string(array.itemsize()) +
                                 "-byte elements cannot be " + py::cast<std::string>(dtype)));
    }
    for (py::ssize_t d = 0; d < array.ndim(); ++d) ref.shape.push_back(static_cast<uint64_t>(array.shape(d)));
    ref.data = array.size() == 0 ? nullptr : array.data();
    return ref;
  }

  std::shared_ptr<CheckpointManager> Peek() {
    std::lock_guard lock(mu_);
    return mgr_;
  }

  std::shared_ptr<CheckpointManager> Get() {
    std::shared_ptr<CheckpointManager> m = Peek();
    if (!m) Check(FailedPreconditionError("the checkpoint manager of " + root_ + " is closed"));
    return m;
  }

  // The wait in progress, or a new one on a helper thread.
  std::shared_ptr<PendingWait> StartWait() {
    auto m = Get();
    std::lock_guard lock(mu_);
    if (pending_) return pending_;
    if (waiter_.joinable()) waiter_.join();  // an earlier wait, already finished
    pending_ = std::make_shared<PendingWait>();
    SignalsBlocked blocked;
    waiter_ = std::thread([m, pending = pending_] { pending->Finish(m->WaitUntilFinished()); });
    return pending_;
  }

  void CollectWait(const std::shared_ptr<PendingWait>& pending) {
    std::lock_guard lock(mu_);
    if (pending_ == pending) pending_.reset();
  }

  // A wait that ended after its caller was interrupted may hold a background
  // failure: report it now rather than lose it.
  void TakeUncollectedWaitError() {
    std::shared_ptr<PendingWait> pending;
    {
      std::lock_guard lock(mu_);
      pending = pending_;
    }
    if (!pending) return;
    bool finished;
    Status status;
    {
      std::lock_guard lock(pending->mu);
      finished = pending->done;
      status = pending->status;
    }
    if (!finished) return;
    CollectWait(pending);
    Check(status);
  }

  std::mutex mu_;  // guards mgr_, pending_, waiter_, abandoned_
  std::shared_ptr<CheckpointManager> mgr_;
  std::shared_ptr<PendingWait> pending_;
  std::thread waiter_;
  bool abandoned_ = false;
  std::string root_;
  bool read_only_ = false;
};

}  // namespace
}  // namespace ckptio::python

namespace ckptio::python {
namespace {

// Set when a save failed in the background and the program never saw the
// error (it was raised only at exit): the process must not exit 0.
std::atomic<bool> g_failed_at_exit{false};

// Runs after the interpreter is finalized (Py_AtExit), after every Python
// atexit handler and stream flush: exits 1 instead of what Python would.
void ExitNonZeroIfFailed() {
  if (g_failed_at_exit.load()) std::exit(1);
}

}  // namespace
}  // namespace ckptio::python

PYBIND11_MODULE(_ckptio, m) {
  using ckptio::python::PyManager;
  using ckptio::python::PySaveHandle;
  m.doc() = "ckptio's C++ core; use the `ckptio` package, not this module.";
  m.attr("__version__") = CKPTIO_VERSION;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ckptio::python::StatusError& e) {
      ckptio::python::SetError(e.status);
    }
  });

  m.def(
      "_set_error_factory",
      [](py::object factory) {
        // Kept forever (see g_error_factory).
        PyObject* old = ckptio::python::g_error_factory;
        ckptio::python::g_error_factory = factory.release().ptr();
        if (old != nullptr) Py_DECREF(old);
      },
      py::arg("factory"));

  // At most once per process, however often the module is imported.
  static const bool at_exit_registered = Py_AtExit(ckptio::python::ExitNonZeroIfFailed) == 0;
  (void)at_exit_registered;
  m.def("_fail_exit_status", [] { ckptio::python::g_failed_at_exit = true; },
        "Makes the process exit with status 1 (after Python's own shutdown): a background save failed "
        "and its error was first reported at exit.");

  m.def("dtype_size", [](const std::string& name) {
    return ckptio::base::DTypeSize(ckptio::python::Take(ckptio::base::ParseDType(name)));
  });
  m.def("default_options_json", [] { return ckptio::config::ToJson(ckptio::Options{}); });
  // ("local", "/abs/path") or ("gcs", "gs://bucket/prefix"); InvalidArgumentError naming
  // the accepted forms for anything else (an unknown scheme, a bad bucket, ...).
  m.def(
      "parse_root",
      [](const std::string& text) {
        ckptio::storage::RootUrl url = ckptio::python::Take(ckptio::storage::ParseRootUrl(text));
        return py::make_tuple(url.kind == ckptio::storage::RootUrl::Kind::kGcs ? "gcs" : "local", url.path);
      },
      py::arg("root"));

  py::class_<PySaveHandle>(m, "SaveHandle")
      .def_property_readonly("step", &PySaveHandle::step)
      .def_property_readonly("skipped", &PySaveHandle::skipped)
      .def_property_readonly("bytes_written", &PySaveHandle::bytes_written)
      .def_property_readonly("timings", &PySaveHandle::timings)
      .def("done", &PySaveHandle::done)
      .def("wait", &PySaveHandle::Wait)
      .def("wait_snapshot", &PySaveHandle::WaitSnapshot)
      .def("error", &PySaveHandle::Error);

  py::class_<PyManager>(m, "Manager")
      .def(py::init<std::string, const std::string&, const std::vector<std::pair<std::string, std::string>>&, bool,
                    const py::object&, const py::object&>(),
           py::arg("root"), py::arg("config"), py::arg("overrides"), py::arg("read_only"),
           py::arg("barrier") = py::none(), py::arg("allgather") = py::none())
      .def("save", &PyManager::Save, py::arg("step"), py::arg("names"), py::arg("dtypes"), py::arg("arrays"),
           py::arg("metadata_json"), py::arg("chunks") = py::none(), py::arg("borrow") = false,
           py::arg("local") = py::none(), py::arg("check") = py::none())
      .def("tensors", &PyManager::Tensors, py::arg("step"))
      .def("restore_slices", &PyManager::RestoreSlices, py::arg("step"), py::arg("slices"))
      .def("hold_prefault", &PyManager::HoldPrefault)
      .def("release_prefault", &PyManager::ReleasePrefault)
      .def("wait_until_ready", &PyManager::WaitUntilReady)
      .def("wait_snapshots", &PyManager::WaitSnapshots)
      .def("wait_until_finished", &PyManager::WaitUntilFinished)
      .def("wait_until_replicated", &PyManager::WaitUntilReplicated)
      .def("close", &PyManager::Close)
      .def("abandon", &PyManager::Abandon)
      .def("restore", &PyManager::Restore, py::arg("step"), py::arg("numpy_dtypes"))
      .def("all_steps", &PyManager::AllSteps)
      .def("tier_steps", &PyManager::TierSteps, py::arg("remote"))
      .def("latest_step", &PyManager::LatestStep)
      .def("refresh", &PyManager::Refresh)
      .def("delete", &PyManager::Delete, py::arg("step"))
      .def("info", &PyManager::Info, py::arg("step"))
      .def("verify", &PyManager::Verify, py::arg("step"))
      .def("stats", &PyManager::Stats)
      .def("options_json", &PyManager::OptionsJson)
      .def_property_readonly("root", &PyManager::root)
      .def_property_readonly("read_only", &PyManager::read_only)
      .def_property_readonly("closed", &PyManager::closed);
}
