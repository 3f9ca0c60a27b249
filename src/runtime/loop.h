#pragma once
// Loop: one io_uring ring driven by one thread, resuming coroutines.
//
// Every in-flight operation is an IoOp whose address is the SQE's user_data;
// completions are reaped in batches and dispatched to IoOp::complete on the
// loop thread. Operations live inside the awaiting coroutine's frame, so an
// operation costs no heap allocation. The awaitable operations (OpenAt, Write,
// Fsync, RenameAt, Poll, Sleep, ...) are declared here and defined in
// runtime/io_ops.h.
//
// Threads: the loop is created on, and runs on, one thread (io_uring's
// SINGLE_ISSUER + DEFER_TASKRUN require that). Only Post(), Stop() and
// BlockOn() may be called from other threads; everything else is loop-thread
// only. A LoopThread (below) creates a loop on a thread of its own.

#include <liburing.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "ckptio/status.h"
#include "runtime/sync_wait.h"
#include "runtime/task.h"

namespace ckptio::runtime {

using base::UniqueFd;

// An operation in the ring. The loop calls complete(self, res, cqe_flags) on
// the loop thread when its CQE arrives. REQUIRES: the object stays alive until
// then, even if it was cancelled (a cancelled op still completes, with
// -ECANCELED). If the loop is destroyed first, it cancels the operation,
// waits for its CQE and calls `discard` (if set) instead of `complete`: the
// way for heap-allocated operations nobody awaits to free themselves.
struct IoOp {
  void (*complete)(IoOp* self, int res, uint32_t cqe_flags) = nullptr;
  void (*discard)(IoOp* self) = nullptr;
};

// Work posted to the loop from any thread. Intrusive: the poster keeps the
// node alive until run(node) has been called on the loop thread. A node still
// queued when the loop is destroyed is not run; `discard`, if set, is called
// instead (to free it).
struct PostNode {
  void (*run)(PostNode* self) = nullptr;
  void (*discard)(PostNode* self) = nullptr;
  PostNode* next = nullptr;
};

// An open file and the path it was opened by, for error messages.
class File {
 public:
  File() = default;
  File(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  const std::string& path() const { return path_; }
  // Gives up ownership of the descriptor (for an asynchronous close).
  int release() { return fd_.release(); }

 private:
  UniqueFd fd_;
  std::string path_;
};

struct LoopOptions {
  unsigned entries = 256;        // submission queue size; the CQ is 4x
  bool single_issuer = true;     // try SINGLE_ISSUER + DEFER_TASKRUN first
};

struct LoopStats {
  uint64_t sqes = 0;         // operations submitted
  uint64_t cqes = 0;         // completions reaped
  uint64_t enters = 0;       // io_uring_enter calls made by the loop
  uint64_t fixed_ops = 0;    // reads/writes that used a registered buffer
};

class Tracer;
class OpenAtOp;
class OpenBeneathOp;
class CloseOp;
class ReadOp;
class ReadVOp;
class WriteOp;
class FsyncOp;
class FallocateOp;
class StatxOp;
class MkdirAtOp;
class RenameAtOp;
class UnlinkAtOp;
class PollOp;
class SleepOp;

class Loop {
 public:
  // Creates a ring on the calling thread, which becomes the loop thread.
  // Fails with a message naming what is missing (io_uring disabled, an opcode
  // this kernel lacks).
  static Result<std::unique_ptr<Loop>> Create(LoopOptions options = {});
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // The loop currently running on this thread, or null.
  static Loop* Current();

  // Runs the loop on the calling (loop) thread until `task` finishes.
  template <typename T>
  T Run(Task<T> task);
  // Runs until Stop() is called.
  void RunForever();
  // Thread-safe. Makes RunForever return after the current iteration.
  void Stop();

  // From any thread other than the loop thread: starts `task` on the loop
  // thread and blocks until it finishes. The loop must be running.
  template <typename T>
  T BlockOn(Task<T> task);

  // Thread-safe: run `node->run(node)` on the loop thread soon.
  void Post(PostNode* node);
  // Thread-safe convenience form (allocates a node).
  void Post(std::function<void()> fn);

  // Loop thread only: resume `h` on a later iteration (never inline).
  void Schedule(std::coroutine_handle<> h) { scheduled_.push_back(h); }
  // Loop thread only: an awaitable that reschedules the caller.
  auto Yield() {
    struct Awaiter {
      Loop* loop;
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) { loop->Schedule(h); }
      void await_resume() const noexcept {}
    };
    return Awaiter{this};
  }

  // Loop thread only. A free SQE (flushes the queue to the kernel if full).
  io_uring_sqe* GetSqe();
  // Loop thread only. Marks `sqe` as belonging to `op`; counts it in flight.
  void Arm(io_uring_sqe* sqe, IoOp* op);
  // Loop thread only. Asks the kernel to cancel `op`; op still completes.
  void Cancel(IoOp* op);

  // Registered (fixed) buffers. Reads and writes whose buffer lies inside a
  // registered region use READ_FIXED/WRITE_FIXED automatically, which saves
  // pinning the pages on every operation. Regions over 1 GiB are split.
  Status RegisterBuffers(std::span<const iovec> regions);
  void UnregisterBuffers();
  // Index of the registered buffer holding [p, p+n), or -1.
  int FindFixedBuffer(const void* p, size_t n) const;

  // Awaitable operations, defined in runtime/io_ops.h. Arguments passed by
  // reference (paths, files, buffers) must stay alive until the operation
  // completes: await the result in the same full expression, as in
  //   CO_ASSIGN_OR_RETURN(File f, co_await loop.OpenAt(AT_FDCWD, path, O_RDONLY));
  OpenAtOp OpenAt(int dirfd, const std::string& path, int flags, mode_t mode = 0644);
  // OpenAt that never follows a symbolic link nor leaves `dirfd` (openat2
  // RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS): ELOOP or EXDEV instead.
  OpenBeneathOp OpenBeneath(int dirfd, const std::string& path, int flags, mode_t mode = 0644);
  CloseOp Close(File& file);
  ReadOp Read(const File& file, void* buf, size_t len, uint64_t offset);
  ReadVOp ReadV(const File& file, struct iovec* iov, size_t n, uint64_t offset);
  WriteOp Write(const File& file, const void* buf, size_t len, uint64_t offset);
  FsyncOp Fsync(const File& file, bool datasync = false);
  FallocateOp Fallocate(const File& file, int mode, uint64_t offset, uint64_t len);
  StatxOp Statx(int dirfd, const std::string& path, int flags = 0, unsigned mask = STATX_BASIC_STATS);
  MkdirAtOp MkdirAt(int dirfd, const std::string& path, mode_t mode = 0755);
  RenameAtOp RenameAt(int olddirfd, const std::string& oldpath, int newdirfd,
                      const std::string& newpath, unsigned flags = 0);
  UnlinkAtOp UnlinkAt(int dirfd, const std::string& path, int flags = 0);
  PollOp Poll(int fd, unsigned poll_mask);
  SleepOp Sleep(std::chrono::nanoseconds duration);

  // Loop thread only. Records a span for every batch of completions.
  void set_tracer(Tracer* tracer) { tracer_ = tracer; }

  // "single_issuer+defer_taskrun", "single_issuer" or "plain".
  const char* setup_mode() const { return setup_mode_; }
  const LoopStats& stats() const { return stats_; }
  size_t in_flight() const { return in_flight_; }
  void NoteFixedOp() { ++stats_.fixed_ops; }

 private:
  Loop() = default;
  // One turn: resume what was scheduled; unless `done()` then holds, submit
  // and reap completions (blocking for one if nothing else is runnable).
  template <typename Done>
  void Turn(Done done) {
    RunScheduled();
    if (done()) return;
    SubmitAndReap(/*block=*/scheduled_.empty());
  }
  void SubmitAndReap(bool block);
  void RunScheduled();
  // Dispatches every completion ready; returns how many there were.
  size_t Reap();
  void ArmWakeup();
  void DrainPosted();
  static void OnWakeup(IoOp* op, int res, uint32_t flags);

  class CurrentGuard {
   public:
    explicit CurrentGuard(Loop* loop);
    ~CurrentGuard();

   private:
    Loop* previous_;
  };

  io_uring ring_{};
  bool ring_ready_ = false;
  bool defer_taskrun_ = false;
  const char* setup_mode_ = "plain";
  std::thread::id owner_;
  size_t in_flight_ = 0;
  Tracer* tracer_ = nullptr;
  LoopStats stats_;
  bool stop_ = false;
  std::deque<std::coroutine_handle<>> scheduled_;

  // Cross-thread wakeup: an eventfd kept under a pending read.
  struct WakeOp : IoOp {
    Loop* loop = nullptr;
  };
  UniqueFd wake_fd_;
  WakeOp wake_op_;
  uint64_t wake_buf_ = 0;
  std::mutex post_mu_;
  bool wake_pending_ = false;      // guarded by post_mu_: the eventfd was written
  PostNode* post_head_ = nullptr;  // guarded by post_mu_
  PostNode* post_tail_ = nullptr;  // guarded by post_mu_

  IoOp cancel_sink_;  // user_data of cancel requests; completes to nothing

  struct FixedRegion {
    const char* base;
    size_t len;
  };
  std::vector<FixedRegion> fixed_;
};

// Flags a bool when a runner finishes (Loop::Run).
namespace detail {
class FlagNotifier final : public ckptio::detail::Notifier {
 public:
  void Notify() noexcept override { done = true; }
  bool done = false;
};
}  // namespace detail

template <typename T>
T Loop::Run(Task<T> task) {
  CurrentGuard guard(this);
  detail::FlagNotifier done;
  auto runner = ckptio::detail::MakeRunner<T>(std::move(task));
  runner.Start(&done);
  while (!done.done) Turn([&done] { return done.done; });
  return runner.Take();
}

template <typename T>
T Loop::BlockOn(Task<T> task) {
  struct Starter final : PostNode {
    std::coroutine_handle<> h;
  };
  ckptio::detail::SemaphoreNotifier done;
  auto runner = ckptio::detail::MakeRunner<T>(std::move(task));
  runner.SetNotifier(&done);
  Starter starter;
  starter.h = runner.handle();
  starter.run = [](PostNode* n) { static_cast<Starter*>(n)->h.resume(); };
  Post(&starter);
  done.Wait();
  return runner.Take();
}

namespace detail {
// Runs a task on another loop's thread and resumes the awaiting coroutine on
// its own loop's thread (both hops by Post). See OnLoop() below.
template <typename T>
class CrossLoop final : ckptio::detail::Notifier {
 public:
  CrossLoop(Loop* target, Task<T> task) : target_(target), runner_(ckptio::detail::MakeRunner<T>(std::move(task))) {
    start_.self = this;
    start_.run = [](PostNode* n) {
      CrossLoop* self = static_cast<Node*>(n)->self;
      self->runner_.Start(self);
    };
    back_.self = this;
    back_.run = [](PostNode* n) { static_cast<Node*>(n)->self->waiter_.resume(); };
  }
  CrossLoop(const CrossLoop&) = delete;
  CrossLoop& operator=(const CrossLoop&) = delete;

  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    waiter_ = h;
    origin_ = Loop::Current();
    target_->Post(&start_);
  }
  T await_resume() { return runner_.Take(); }

 private:
  struct Node : PostNode {
    CrossLoop* self = nullptr;
  };
  // On the target's thread, as the task finishes: nothing of *this is
  // touched after the Post (the origin may resume and destroy it at once).
  // A caller on no loop (SyncWait) is resumed right here instead.
  void Notify() noexcept override {
    if (origin_ != nullptr) {
      origin_->Post(&back_);
    } else {
      waiter_.resume();
    }
  }

  Loop* target_;
  Loop* origin_ = nullptr;
  std::coroutine_handle<> waiter_;
  ckptio::detail::RunnerTask<T> runner_;
  Node start_;
  Node back_;
};
}  // namespace detail

// Awaitable from a coroutine running on a loop: runs `task` on `target`'s
// thread (inline if that is this loop) and resumes the caller on its own
// loop with the task's result or exception. Whatever the task references
// must be safe to use from the target's thread meanwhile; the Posts order
// everything written before the call, and by the task, with the other side.
// REQUIRES: `target` runs until the task finishes.
template <typename T>
Task<T> OnLoop(Loop& target, Task<T> task) {
  if (&target == Loop::Current()) co_return co_await task;
  detail::CrossLoop<T> hop(&target, std::move(task));
  if constexpr (std::is_void_v<T>) {
    co_await hop;
  } else {
    co_return co_await hop;
  }
}

// A Loop running on a thread of its own until the LoopThread is destroyed.
class LoopThread {
 public:
  static Result<std::unique_ptr<LoopThread>> Start(LoopOptions options = {},
                                                   std::string name = "ckptio-loop");
  ~LoopThread();  // stops the loop and joins the thread
  Loop& loop() { return *loop_; }
  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  LoopThread() = default;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

}  // namespace ckptio::runtime
