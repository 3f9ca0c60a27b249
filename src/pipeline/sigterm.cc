#include "pipeline/sigterm.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

namespace ckptio::pipeline {
namespace {

std::atomic<int> g_wake_fd{-1};
constexpr uint64_t kSigterm = 1;
constexpr uint64_t kStop = uint64_t{1} << 32;

}  // namespace

void SigtermWatcher::Handler(int) {
  int saved = errno;  // async-signal-safe: only write(2)
  uint64_t v = kSigterm;
  int fd = g_wake_fd.load();
  if (fd >= 0) {
    [[maybe_unused]] ssize_t w = ::write(fd, &v, sizeof v);
  }
  errno = saved;
}

Result<std::unique_ptr<SigtermWatcher>> SigtermWatcher::Install(std::function<void()> on_sigterm) {
  std::unique_ptr<SigtermWatcher> w(new SigtermWatcher());
  w->on_sigterm_ = std::move(on_sigterm);
  w->fd_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!w->fd_.valid()) return ErrnoToStatus(errno, "cannot create the SIGTERM eventfd");
  int expected = -1;
  if (!g_wake_fd.compare_exchange_strong(expected, w->fd_.get())) {
    return FailedPreconditionError("preemption.on_sigterm: another CheckpointManager already handles SIGTERM");
  }
  struct sigaction sa {};
  sa.sa_handler = &SigtermWatcher::Handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(SIGTERM, &sa, &w->previous_) != 0) {
    g_wake_fd = -1;
    return ErrnoToStatus(errno, "cannot install the SIGTERM handler");
  }
  SigtermWatcher* raw = w.get();
  w->thread_ = std::thread([raw] { raw->Main(); });
  return w;
}

void SigtermWatcher::Main() {
  pthread_setname_np(pthread_self(), "ckptio-sigterm");
  for (;;) {
    uint64_t v = 0;
    if (::read(fd_.get(), &v, sizeof v) != sizeof v) {
      if (errno == EINTR) continue;
      return;
    }
    if (v >= kStop) return;
    on_sigterm_();
    return;  // one SIGTERM is handled; a second one meets the handler again and is ignored
  }
}

void SigtermWatcher::RaisePrevious() {
  if (!restored_) {
    ::sigaction(SIGTERM, &previous_, nullptr);
    restored_ = true;
  }
  ::raise(SIGTERM);
}

SigtermWatcher::~SigtermWatcher() {
  uint64_t v = kStop;
  [[maybe_unused]] ssize_t w = ::write(fd_.get(), &v, sizeof v);
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // destroyed from its own callback
    } else {
      thread_.join();
    }
  }
  if (!restored_) ::sigaction(SIGTERM, &previous_, nullptr);
  g_wake_fd = -1;
}

}  // namespace ckptio::pipeline
