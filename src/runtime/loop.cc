#include "runtime/loop.h"

#include <sys/eventfd.h>
#include <pthread.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>

#include "runtime/trace.h"

namespace ckptio::runtime {
namespace {

thread_local Loop* tls_current_loop = nullptr;

struct RequiredOp {
  int opcode;
  const char* name;
  const char* since;
};
// Everything the runtime uses. Probed once so a missing opcode fails at
// start-up with its name, not later as a mysterious EINVAL.
constexpr RequiredOp kRequiredOps[] = {
    {IORING_OP_NOP, "NOP", "5.1"},
    {IORING_OP_READ, "READ", "5.6"},
    {IORING_OP_WRITE, "WRITE", "5.6"},
    {IORING_OP_READ_FIXED, "READ_FIXED", "5.1"},
    {IORING_OP_WRITE_FIXED, "WRITE_FIXED", "5.1"},
    {IORING_OP_FSYNC, "FSYNC", "5.1"},
    {IORING_OP_FALLOCATE, "FALLOCATE", "5.6"},
    {IORING_OP_OPENAT, "OPENAT", "5.6"},
    {IORING_OP_OPENAT2, "OPENAT2", "5.6"},
    {IORING_OP_CLOSE, "CLOSE", "5.6"},
    {IORING_OP_STATX, "STATX", "5.6"},
    {IORING_OP_MKDIRAT, "MKDIRAT", "5.15"},
    {IORING_OP_RENAMEAT, "RENAMEAT", "5.11"},
    {IORING_OP_UNLINKAT, "UNLINKAT", "5.11"},
    {IORING_OP_POLL_ADD, "POLL_ADD", "5.1"},
    {IORING_OP_TIMEOUT, "TIMEOUT", "5.4"},
    {IORING_OP_ASYNC_CANCEL, "ASYNC_CANCEL", "5.5"},
};

Status RingSetupError(int err) {
  switch (-err) {
    case ENOSYS:
      return UnimplementedError("cannot create io_uring: this kernel was built without io_uring");
    case EPERM:
      return Status(StatusCode::kPermissionDenied,
                    "cannot create io_uring: it is disabled for this process "
                    "(check sysctl kernel.io_uring_disabled and seccomp policy)",
                    EPERM);
    case ENOMEM:
      return Status(StatusCode::kResourceExhausted,
                    "cannot create io_uring: out of locked memory (raise RLIMIT_MEMLOCK)", ENOMEM);
    default:
      return ErrnoToStatus(err, "cannot create io_uring");
  }
}

}  // namespace

Loop::CurrentGuard::CurrentGuard(Loop* loop) : previous_(tls_current_loop) { tls_current_loop = loop; }
Loop::CurrentGuard::~CurrentGuard() { tls_current_loop = previous_; }

Loop* Loop::Current() { return tls_current_loop; }

Result<std::unique_ptr<Loop>> Loop::Create(LoopOptions options) {
  std::unique_ptr<Loop> loop(new Loop());
  struct Attempt {
    unsigned flags;
    const char* mode;
  };
  const Attempt attempts[] = {
      {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, "single_issuer+defer_taskrun"},
      {IORING_SETUP_SINGLE_ISSUER, "single_issuer"},
      {0, "plain"},
  };
  int r = -EINVAL;
  for (const Attempt& a : attempts) {
    if (!options.single_issuer && a.flags != 0) continue;
    io_uring_params p{};
    p.flags = a.flags | IORING_SETUP_CQSIZE;
    p.cq_entries = options.entries * 4;
    r = io_uring_queue_init_params(options.entries, &loop->ring_, &p);
    if (r == 0) {
      loop->setup_mode_ = a.mode;
      loop->defer_taskrun_ = (a.flags & IORING_SETUP_DEFER_TASKRUN) != 0;
      break;
    }
    if (r != -EINVAL) break;  // EINVAL: flags unknown to this kernel, try fewer
  }
  if (r != 0) return RingSetupError(r);
  loop->ring_ready_ = true;
  loop->owner_ = std::this_thread::get_id();

  io_uring_probe* probe = io_uring_get_probe_ring(&loop->ring_);
  if (probe == nullptr) return UnimplementedError("cannot probe io_uring opcodes (kernel older than 5.6)");
  std::string missing;
  for (const RequiredOp& op : kRequiredOps) {
    if (!io_uring_opcode_supported(probe, op.opcode)) {
      missing += missing.empty() ? "" : ", ";
      missing += std::string(op.name) + " (Linux " + op.since + ")";
    }
  }
  io_uring_free_probe(probe);
  if (!missing.empty()) {
    return UnimplementedError("io_uring on this kernel lacks operations ckptio needs: " + missing);
  }

  int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) return ErrnoToStatus(errno, "cannot create the loop's eventfd");
  loop->wake_fd_.reset(efd);
  loop->wake_op_.complete = &Loop::OnWakeup;
  loop->wake_op_.loop = loop.get();
  loop->cancel_sink_.complete = [](IoOp*, int, uint32_t) {};
  loop->ArmWakeup();
  return loop;
}

Loop::~Loop() {
  if (!ring_ready_) return;
  // Nothing may be left for the kernel to write into once we return: cancel
  // everything still in flight and wait for every completion, without
  // dispatching it (the coroutines that owned those operations are gone).
  if (in_flight_ > 0) {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
    io_uring_sqe_set_data(sqe, nullptr);
    ++in_flight_;
    while (in_flight_ > 0) {
      int r = io_uring_submit_and_wait(&ring_, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) break;
      io_uring_cqe* cqe;
      unsigned head, n = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++n;
        auto* op = static_cast<IoOp*>(io_uring_cqe_get_data(cqe));
        if (op != nullptr && op->discard != nullptr) op->discard(op);
      }
      io_uring_cq_advance(&ring_, n);
      in_flight_ -= std::min<size_t>(n, in_flight_);
    }
  }
  UnregisterBuffers();
  io_uring_queue_exit(&ring_);
  // Nodes posted after the loop stopped are dropped, not run: running them
  // would resume coroutines on a loop that no longer exists.
  while (post_head_ != nullptr) {
    PostNode* n = post_head_;
    post_head_ = n->next;
    if (n->discard != nullptr) n->discard(n);
  }
}

io_uring_sqe* Loop::GetSqe() {
  for (;;) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe != nullptr) return sqe;
    // The submission queue is full: hand it to the kernel. With the CQ sized
    // 4x and IORING_FEAT_NODROP this only fails transiently.
    ++stats_.enters;
    int r = io_uring_submit(&ring_);
    if (r < 0 && r != -EAGAIN && r != -EBUSY && r != -EINTR) {
      std::fprintf(stderr, "ckptio: io_uring_submit failed: %s\n", std::strerror(-r));
      std::abort();
    }
  }
}

void Loop::Arm(io_uring_sqe* sqe, IoOp* op) {
  io_uring_sqe_set_data(sqe, op);
  ++in_flight_;
  ++stats_.sqes;
}

void Loop::Cancel(IoOp* op) {
  io_uring_sqe* sqe = GetSqe();
  io_uring_prep_cancel64(sqe, reinterpret_cast<uint64_t>(op), 0);
  Arm(sqe, &cancel_sink_);
}

void Loop::Stop() {
  Post([this] { stop_ = true; });
}

void Loop::RunForever() {
  CurrentGuard guard(this);
  stop_ = false;
  while (!stop_) Turn([this] { return stop_; });
}

void Loop::RunScheduled() {
  // Only what was scheduled before this call runs now, so a coroutine that
  // keeps yielding cannot starve completions.
  size_t n = scheduled_.size();
  for (size_t i = 0; i < n; ++i) {
    std::coroutine_handle<> h = scheduled_.front();
    scheduled_.pop_front();
    h.resume();
  }
}

void Loop::SubmitAndReap(bool block) {
  ++stats_.enters;
  const uint64_t sqes_before = stats_.sqes;
  int r = block ? io_uring_submit_and_wait(&ring_, 1) : io_uring_submit(&ring_);
  // Read once: the tracer may be set by a posted task run inside Reap(), and
  // a span must not start at the clock's epoch.
  Tracer* const tracer = tracer_;
  const auto woke = tracer != nullptr ? Tracer::Clock::now() : Tracer::Clock::time_point();
  if (!block && defer_taskrun_) io_uring_get_events(&ring_);
  if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
    std::fprintf(stderr, "ckptio: io_uring_enter failed: %s\n", std::strerror(-r));
    std::abort();
  }
  size_t reaped = Reap();
  if (tracer != nullptr && reaped > 0) {
    // From the wake-up on: the time the loop was busy dispatching, not idle.
    tracer->Span(Track::kIo, "batch of " + std::to_string(reaped), woke, Tracer::Clock::now(),
                  "{\"completions\":" + std::to_string(reaped) + ",\"submitted\":" +
                      std::to_string(stats_.sqes - sqes_before) + "}");
  }
}

size_t Loop::Reap() {
  size_t total = 0;
  constexpr unsigned kBatch = 64;
  io_uring_cqe* cqes[kBatch];
  struct Done {
    IoOp* op;
    int res;
    uint32_t flags;
  };
  Done batch[kBatch];
  for (;;) {
    unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, kBatch);
    if (n == 0) return total;
    total += n;
    // Copy and release the CQ slots before dispatching: a completion handler
    // may submit new work.
    for (unsigned i = 0; i < n; ++i) {
      batch[i] = {static_cast<IoOp*>(io_uring_cqe_get_data(cqes[i])), cqes[i]->res, cqes[i]->flags};
    }
    io_uring_cq_advance(&ring_, n);
    in_flight_ -= n;
    stats_.cqes += n;
    for (unsigned i = 0; i < n; ++i) {
      if (batch[i].op != nullptr) batch[i].op->complete(batch[i].op, batch[i].res, batch[i].flags);
    }
  }
}

void Loop::ArmWakeup() {
  io_uring_sqe* sqe = GetSqe();
  io_uring_prep_read(sqe, wake_fd_.get(), &wake_buf_, sizeof wake_buf_, 0);
  Arm(sqe, &wake_op_);
}

void Loop::OnWakeup(IoOp* op, int res, uint32_t) {
  Loop* self = static_cast<WakeOp*>(op)->loop;
  if (res == -ECANCELED) return;  // the loop is being destroyed
  self->DrainPosted();
  self->ArmWakeup();
}

void Loop::DrainPosted() {
  PostNode* head;
  {
    std::lock_guard lock(post_mu_);
    wake_pending_ = false;  // the next Post writes the eventfd again
    head = post_head_;
    post_head_ = post_tail_ = nullptr;
  }
  while (head != nullptr) {
    PostNode* next = head->next;  // run() may free the node
    head->run(head);
    head = next;
  }
}

void Loop::Post(PostNode* node) {
  node->next = nullptr;
  // The whole post, eventfd write included, happens under the lock: the loop
  // runs a node only after taking the lock, so it cannot run (say) a Stop
  // and destroy itself while this thread still touches its members.
  std::lock_guard lock(post_mu_);
  if (post_tail_ != nullptr) {
    post_tail_->next = node;
  } else {
    post_head_ = node;
  }
  post_tail_ = node;
  if (!wake_pending_) {
    wake_pending_ = true;
    uint64_t one = 1;
    // EAGAIN means the counter is already non-zero: the loop will wake anyway.
    [[maybe_unused]] ssize_t w = ::write(wake_fd_.get(), &one, sizeof one);
  }
}

void Loop::Post(std::function<void()> fn) {
  struct FnNode final : PostNode {
    std::function<void()> fn;
  };
  auto* node = new FnNode;
  node->fn = std::move(fn);
  node->run = [](PostNode* n) {
    std::unique_ptr<FnNode> self(static_cast<FnNode*>(n));
    self->fn();
  };
  node->discard = [](PostNode* n) { delete static_cast<FnNode*>(n); };
  Post(static_cast<PostNode*>(node));
}

Status Loop::RegisterBuffers(std::span<const iovec> regions) {
  UnregisterBuffers();
  constexpr size_t kMaxRegion = size_t{1} << 30;  // the kernel's per-buffer limit
  std::vector<iovec> iovs;
  for (const iovec& r : regions) {
    auto* base = static_cast<char*>(r.iov_base);
    for (size_t off = 0; off < r.iov_len; off += kMaxRegion) {
      iovs.push_back({base + off, std::min(kMaxRegion, r.iov_len - off)});
    }
  }
  if (iovs.empty()) return Status::Ok();
  int r = io_uring_register_buffers(&ring_, iovs.data(), static_cast<unsigned>(iovs.size()));
  if (r < 0) return ErrnoToStatus(r, "cannot register staging buffers with io_uring");
  for (const iovec& v : iovs) fixed_.push_back({static_cast<const char*>(v.iov_base), v.iov_len});
  return Status::Ok();
}

void Loop::UnregisterBuffers() {
  if (fixed_.empty()) return;
  io_uring_unregister_buffers(&ring_);
  fixed_.clear();
}

int Loop::FindFixedBuffer(const void* p, size_t n) const {
  auto* c = static_cast<const char*>(p);
  for (size_t i = 0; i < fixed_.size(); ++i) {
    if (c >= fixed_[i].base && c + n <= fixed_[i].base + fixed_[i].len) return static_cast<int>(i);
  }
  return -1;
}

Result<std::unique_ptr<LoopThread>> LoopThread::Start(LoopOptions options, std::string name) {
  std::unique_ptr<LoopThread> lt(new LoopThread());
  std::promise<Status> created;
  std::future<Status> created_future = created.get_future();
  LoopThread* raw = lt.get();
  lt->thread_ = std::thread([raw, options, name, &created] {
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    auto loop = Loop::Create(options);
    if (!loop.ok()) {
      created.set_value(loop.status());
      return;
    }
    raw->loop_ = std::move(loop).value();
    created.set_value(Status::Ok());
    raw->loop_->RunForever();
    raw->loop_.reset();  // destroyed on the thread that owns the ring
  });
  Status s = created_future.get();
  if (!s.ok()) {
    lt->thread_.join();
    return s;
  }
  return lt;
}

LoopThread::~LoopThread() {
  if (thread_.joinable()) {
    if (loop_) loop_->Stop();
    thread_.join();
  }
}

}  // namespace ckptio::runtime
