// The io_uring Loop against the real file system.

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "runtime/task.h"
#include "runtime/when_all.h"
#include "runtime/async_sync.h"
#include "runtime/cpu_pool.h"
#include "runtime/io_ops.h"
#include "runtime/loop.h"
#include "test_util.h"

namespace ckptio::runtime {
namespace {

using testing::ReadWholeFile;
using testing::TempDir;
namespace fs = std::filesystem;

std::unique_ptr<Loop> NewLoop() {
  auto loop = Loop::Create();
  REQUIRE_MESSAGE(loop.ok(), loop.status().ToString());
  return std::move(loop).value();
}

std::string Pattern(size_t n, unsigned seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return s;
}

Task<Status> WriteFile(Loop& loop, std::string path, std::string data) {
  CO_ASSIGN_OR_RETURN(File f, co_await loop.OpenAt(AT_FDCWD, path, O_WRONLY | O_CREAT | O_TRUNC));
  CO_TRY(co_await loop.Write(f, data.data(), data.size(), 0));
  CO_TRY(co_await loop.Fsync(f));
  co_return co_await loop.Close(f);
}

Task<Result<std::string>> ReadFile(Loop& loop, std::string path, size_t max) {
  CO_ASSIGN_OR_RETURN(File f, co_await loop.OpenAt(AT_FDCWD, path, O_RDONLY));
  std::string out(max, '\0');
  CO_ASSIGN_OR_RETURN(size_t n, co_await loop.Read(f, out.data(), out.size(), 0));
  out.resize(n);
  CO_TRY(co_await loop.Close(f));
  co_return out;
}

TEST_CASE("the loop reports how its ring was set up") {
  auto loop = NewLoop();
  std::string mode = loop->setup_mode();
  CHECK((mode == "single_issuer+defer_taskrun" || mode == "single_issuer" || mode == "plain"));
  MESSAGE("io_uring setup: " << mode);
}

TEST_CASE("a file written through the loop reads back equal, through the loop and through the OS") {
  TempDir dir;
  auto loop = NewLoop();
  const std::string path = dir / "a.bin";
  const std::string data = Pattern(3 * 1024 * 1024 + 17, 1);
  Status w = loop->Run(WriteFile(*loop, path, data));
  REQUIRE_MESSAGE(w.ok(), w.ToString());
  CHECK(ReadWholeFile(path) == data);
  Result<std::string> r = loop->Run(ReadFile(*loop, path, data.size() + 100));
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(*r == data);  // a short read at end of file returns what is there
}

TEST_CASE("64 files written concurrently all land with their own contents") {
  TempDir dir;
  auto loop = NewLoop();
  std::vector<Task<Status>> writes;
  for (unsigned i = 0; i < 64; ++i) {
    writes.push_back(WriteFile(*loop, dir / ("f" + std::to_string(i)), Pattern(256 * 1024 + i, i)));
  }
  std::vector<Status> results = loop->Run(WhenAll(std::move(writes)));
  for (const Status& s : results) CHECK_MESSAGE(s.ok(), s.ToString());
  for (unsigned i = 0; i < 64; ++i) {
    CHECK(ReadWholeFile(dir / ("f" + std::to_string(i))) == Pattern(256 * 1024 + i, i));
  }
}

TEST_CASE("mkdirat, renameat and unlinkat are observed on disk") {
  TempDir dir;
  auto loop = NewLoop();
  auto steps = [](Loop& l, std::string root) -> Task<Status> {
    CO_TRY(co_await l.MkdirAt(AT_FDCWD, root + "/sub"));
    CO_TRY(co_await WriteFile(l, root + "/sub/x", "hello"));
    CO_TRY(co_await l.RenameAt(AT_FDCWD, root + "/sub/x", AT_FDCWD, root + "/sub/y"));
    CO_ASSIGN_OR_RETURN(struct statx st, co_await l.Statx(AT_FDCWD, root + "/sub/y"));
    if (st.stx_size != 5) co_return InternalError("statx size " + std::to_string(st.stx_size));
    CO_TRY(co_await l.UnlinkAt(AT_FDCWD, root + "/sub/y"));
    co_return Status::Ok();
  };
  Status s = loop->Run(steps(*loop, dir.path()));
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(fs::is_directory(dir / "sub"));
  CHECK_FALSE(fs::exists(dir / "sub/x"));
  CHECK_FALSE(fs::exists(dir / "sub/y"));
}

TEST_CASE("opening a missing path returns NotFound naming the path and the errno text") {
  TempDir dir;
  auto loop = NewLoop();
  const std::string missing = dir / "no/such/file";
  auto open = [](Loop& l, std::string p) -> Task<Status> {
    auto f = co_await l.OpenAt(AT_FDCWD, p, O_RDONLY);
    co_return f.status();
  };
  Status s = loop->Run(open(*loop, missing));
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.sys_errno() == ENOENT);
  CHECK(s.message() == "open " + missing + ": No such file or directory");
}

TEST_CASE("writing to a read-only descriptor returns an error naming the path") {
  TempDir dir;
  auto loop = NewLoop();
  const std::string path = dir / "ro";
  testing::WriteWholeFile(path, "abc");
  auto write_ro = [](Loop& l, std::string p) -> Task<Status> {
    CO_ASSIGN_OR_RETURN(File f, co_await l.OpenAt(AT_FDCWD, p, O_RDONLY));
    const char byte = 'x';
    Status s = co_await l.Write(f, &byte, 1, 0);
    CO_TRY(co_await l.Close(f));
    co_return s;
  };
  Status s = loop->Run(write_ro(*loop, path));
  CHECK(s.sys_errno() == EBADF);
  CHECK(s.message() == "write " + path + ": Bad file descriptor");
  CHECK(ReadWholeFile(path) == "abc");
}

TEST_CASE("an O_DIRECT write from an aligned, registered buffer lands and reads back") {
  TempDir dir;
  auto loop = NewLoop();
  constexpr size_t kLen = 4 << 20;
  void* raw = nullptr;
  REQUIRE(posix_memalign(&raw, 4096, kLen) == 0);
  std::unique_ptr<char, decltype(&std::free)> buf(static_cast<char*>(raw), &std::free);
  const std::string data = Pattern(kLen, 9);
  std::memcpy(buf.get(), data.data(), kLen);
  iovec region{buf.get(), kLen};
  REQUIRE(loop->RegisterBuffers({&region, 1}).ok());
  CHECK(loop->FindFixedBuffer(buf.get() + 4096, 4096) == 0);
  CHECK(loop->FindFixedBuffer(data.data(), 1) == -1);
  auto write_direct = [](Loop& l, std::string p, const char* b) -> Task<Status> {
    CO_ASSIGN_OR_RETURN(File f, co_await l.OpenAt(AT_FDCWD, p, O_WRONLY | O_CREAT | O_DIRECT));
    CO_TRY(co_await l.Fallocate(f, 0, 0, kLen));
    for (size_t off = 0; off < kLen; off += 1 << 20) CO_TRY(co_await l.Write(f, b + off, 1 << 20, off));
    CO_TRY(co_await l.Fsync(f, /*datasync=*/true));
    co_return co_await l.Close(f);
  };
  const std::string path = dir / "direct";
  Status s = loop->Run(write_direct(*loop, path, buf.get()));
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(loop->stats().fixed_ops >= 4);
  CHECK(ReadWholeFile(path) == data);
  loop->UnregisterBuffers();
}

TEST_CASE("Post from another thread runs on the loop thread") {
  auto lt = LoopThread::Start();
  REQUIRE(lt.ok());
  Loop& loop = (*lt)->loop();
  std::atomic<bool> ran{false};
  std::thread::id ran_on;
  std::binary_semaphore done{0};
  std::thread poster([&] {
    loop.Post([&] {
      ran_on = std::this_thread::get_id();
      ran = true;
      done.release();
    });
  });
  poster.join();
  done.acquire();
  CHECK(ran);
  CHECK(ran_on == (*lt)->thread_id());
}

TEST_CASE("many posts from several threads all run, none lost") {
  auto lt = LoopThread::Start();
  REQUIRE(lt.ok());
  Loop& loop = (*lt)->loop();
  int count = 0;  // touched only on the loop thread
  std::vector<std::thread> posters;
  for (int t = 0; t < 4; ++t) {
    posters.emplace_back([&] {
      for (int i = 0; i < 10'000; ++i) loop.Post([&] { ++count; });
    });
  }
  for (auto& t : posters) t.join();
  auto read_count = [](int* c) -> Task<int> { co_return *c; };
  CHECK(loop.BlockOn(read_count(&count)) == 40'000);
}

TEST_CASE("OnLoop runs a task on another loop's thread and resumes on the caller's loop") {
  auto main_lt = LoopThread::Start();
  auto other_lt = LoopThread::Start();
  REQUIRE(main_lt.ok());
  REQUIRE(other_lt.ok());
  Loop& main_loop = (*main_lt)->loop();
  Loop& other = (*other_lt)->loop();
  const std::thread::id main_id = (*main_lt)->thread_id();
  const std::thread::id other_id = (*other_lt)->thread_id();

  struct Seen {
    std::thread::id task_on, resumed_on, inline_on, void_on;
    int value = 0;
    std::string error;
    int sleeps_done = 0;  // of the 64 at once: right value, on the other loop
  };
  auto on_other = [](std::thread::id* where, int x) -> Task<int> {
    *where = std::this_thread::get_id();
    // Real I/O on the other loop's ring, not just a hop.
    Status slept = co_await Loop::Current()->Sleep(std::chrono::milliseconds(1));
    CHECK(slept.ok());
    co_return x * 2;
  };
  auto throws = []() -> Task<int> {
    throw std::runtime_error("thrown on the other loop");
    co_return 0;
  };
  auto void_task = [](std::thread::id* where) -> Task<void> {
    *where = std::this_thread::get_id();
    co_return;
  };
  auto scenario = [&](Seen* seen) -> Task<void> {
    seen->value = co_await OnLoop(other, on_other(&seen->task_on, 21));
    seen->resumed_on = std::this_thread::get_id();
    try {
      int unused = co_await OnLoop(other, throws());
      (void)unused;
    } catch (const std::runtime_error& e) {
      seen->error = e.what();
    }
    co_await OnLoop(other, void_task(&seen->void_on));
    // The same loop: runs inline, no hop.
    int same = co_await OnLoop(main_loop, on_other(&seen->inline_on, 1));
    CHECK(same == 2);
    // Many at once, all on the other loop.
    std::vector<Task<int>> many;
    std::vector<std::thread::id> where(64);
    for (int i = 0; i < 64; ++i) many.push_back(OnLoop(other, on_other(&where[i], i)));
    std::vector<int> got = co_await WhenAll(std::move(many));
    for (int i = 0; i < 64; ++i) {
      if (got[i] == 2 * i && where[i] == other_id) ++seen->sleeps_done;
    }
  };
  Seen seen;
  main_loop.BlockOn(scenario(&seen));
  CHECK(seen.value == 42);
  CHECK(seen.task_on == other_id);
  CHECK(seen.resumed_on == main_id);
  CHECK(seen.error == "thrown on the other loop");
  CHECK(seen.void_on == other_id);
  CHECK(seen.inline_on == main_id);
  CHECK(seen.sleeps_done == 64);
}

TEST_CASE("an urgent job goes first and loses none of the jobs queued behind it") {
  // One worker, held busy, so every job below waits in the queue. An urgent
  // job used to become the queue's tail too, so the next normal job was
  // linked after it and the jobs in between were lost (a save hung on its
  // CRC32C lanes).
  CpuPool pool(1);
  std::mutex mu;
  std::vector<std::string> ran;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  struct Named : CpuPool::Job {
    std::string name;
    std::mutex* mu;
    std::vector<std::string>* ran;
    std::promise<void>* started = nullptr;   // set when it starts, if given
    std::shared_future<void> gate;           // then waited for, if valid
    std::promise<void>* finished = nullptr;  // set once it has run, if given
  };
  std::vector<std::unique_ptr<Named>> jobs;
  auto make = [&](std::string name) {
    auto j = std::make_unique<Named>();
    j->name = std::move(name);
    j->mu = &mu;
    j->ran = &ran;
    j->run = [](CpuPool::Job* job) {
      auto* self = static_cast<Named*>(job);
      if (self->started != nullptr) self->started->set_value();
      if (self->gate.valid()) self->gate.wait();
      {
        std::lock_guard lock(*self->mu);
        self->ran->push_back(self->name);
      }
      if (self->finished != nullptr) self->finished->set_value();
    };
    jobs.push_back(std::move(j));
    return jobs.back().get();
  };
  std::promise<void> blocker_started;
  Named* blocker = make("blocker");
  blocker->started = &blocker_started;
  blocker->gate = released;
  pool.Enqueue(blocker);
  blocker_started.get_future().wait();  // off the queue, and holding the worker
  REQUIRE(pool.queued() == 0);
  pool.Enqueue(make("a"));
  pool.Enqueue(make("b"));
  pool.Enqueue(make("urgent"), /*urgent=*/true);
  pool.Enqueue(make("c"));
  release.set_value();
  // One worker runs the queue in order: once a job queued last has run,
  // every job before it has run too, or was lost.
  std::promise<void> last_finished;
  Named* last = make("last");
  last->finished = &last_finished;
  pool.Enqueue(last);
  last_finished.get_future().wait();
  std::lock_guard lock(mu);
  CHECK(ran == std::vector<std::string>{"blocker", "urgent", "a", "b", "c", "last"});
}

TEST_CASE("pool.Run runs on a worker and resumes on the loop thread") {
  auto loop = NewLoop();
  CpuPool pool(2);
  std::thread::id loop_thread = std::this_thread::get_id();
  auto body = [](CpuPool& p) -> Task<std::pair<std::thread::id, std::thread::id>> {
    auto work = [] { return std::this_thread::get_id(); };
    std::thread::id worker = co_await p.Run(work);
    co_return std::make_pair(worker, std::this_thread::get_id());
  };
  auto [worker, resumed_on] = loop->Run(body(pool));
  CHECK(worker != loop_thread);
  CHECK(resumed_on == loop_thread);
}

TEST_CASE("pool.Run carries a callable with owned state and propagates exceptions") {
  auto loop = NewLoop();
  CpuPool pool(2);
  auto body = [](CpuPool& p) -> Task<std::string> {
    std::string owned(64, 'z');
    auto work = [owned] { return owned.size(); };  // named first (g++ 12)
    size_t n = co_await p.Run(work);
    auto fail = []() -> int { throw std::runtime_error("worker failed"); };
    try {
      co_await p.Run(fail);
    } catch (const std::runtime_error& e) {
      co_return std::to_string(n) + " " + e.what();
    }
    co_return "no exception";
  };
  CHECK(loop->Run(body(pool)) == "64 worker failed");
}

TEST_CASE("ParallelFor visits every index exactly once") {
  CpuPool pool(2);
  std::vector<std::atomic<int>> hits(1000);
  pool.ParallelFor(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
  int wrong = 0;
  for (auto& h : hits) wrong += h.load() != 1;
  CHECK(wrong == 0);
}

TEST_CASE("a timeout fires after at least its duration") {
  auto loop = NewLoop();
  auto sleeper = [](Loop& l) -> Task<Status> { co_return co_await l.Sleep(std::chrono::milliseconds(20)); };
  auto start = std::chrono::steady_clock::now();
  Status s = loop->Run(sleeper(*loop));
  CHECK(s.ok());
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(20));
}

TEST_CASE("poll on a pipe completes when another thread writes to it") {
  auto loop = NewLoop();
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  UniqueFd rd(fds[0]), wr(fds[1]);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    REQUIRE(write(wr.get(), "x", 1) == 1);
  });
  auto waiter = [](Loop& l, int fd) -> Task<Result<unsigned>> { co_return co_await l.Poll(fd, POLLIN); };
  Result<unsigned> ev = loop->Run(waiter(*loop, rd.get()));
  writer.join();
  REQUIRE(ev.ok());
  CHECK((*ev & POLLIN) != 0);
}

// A poll whose completion resumes nobody, for the cancellation tests.
struct DetachedPoll : IoOp {
  int res = 1;
  bool completed = false;
  DetachedPoll() {
    complete = [](IoOp* op, int r, uint32_t) {
      auto* self = static_cast<DetachedPoll*>(op);
      self->res = r;
      self->completed = true;
    };
  }
};

TEST_CASE("a cancelled poll completes with ECANCELED") {
  auto loop = NewLoop();
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  UniqueFd rd(fds[0]), wr(fds[1]);
  DetachedPoll op;
  auto body = [](Loop& l, DetachedPoll* p, int fd) -> Task<void> {
    io_uring_sqe* sqe = l.GetSqe();
    io_uring_prep_poll_add(sqe, fd, POLLIN);
    l.Arm(sqe, p);
    co_await l.Yield();  // let it reach the kernel
    l.Cancel(p);
    while (!p->completed) co_await l.Yield();
  };
  loop->Run(body(*loop, &op, rd.get()));
  CHECK(op.res == -ECANCELED);
}

TEST_CASE("destroying a loop with an operation still in the ring waits for it safely") {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  UniqueFd rd(fds[0]), wr(fds[1]);
  auto op = std::make_unique<DetachedPoll>();
  {
    auto loop = NewLoop();
    auto arm = [](Loop& l, DetachedPoll* p, int fd) -> Task<void> {
      io_uring_sqe* sqe = l.GetSqe();
      io_uring_prep_poll_add(sqe, fd, POLLIN);
      l.Arm(sqe, p);
      co_await l.Yield();
    };
    loop->Run(arm(*loop, op.get(), rd.get()));
    CHECK(loop->in_flight() >= 2);  // the poll and the loop's own wakeup read
  }
  CHECK_FALSE(op->completed);  // drained, not dispatched
}

TEST_CASE("an async semaphore bounds how many tasks run at once") {
  auto loop = NewLoop();
  AsyncSemaphore sem(3);
  int running = 0, peak = 0;
  auto worker = [](Loop& l, AsyncSemaphore& s, int& run, int& pk) -> Task<void> {
    co_await s.Acquire();
    pk = std::max(pk, ++run);
    co_await l.Sleep(std::chrono::milliseconds(1));
    --run;
    s.Release();
  };
  std::vector<Task<void>> tasks;
  for (int i = 0; i < 20; ++i) tasks.push_back(worker(*loop, sem, running, peak));
  loop->Run(WhenAll(std::move(tasks)));
  CHECK(peak == 3);
  CHECK(sem.available() == 3);
}

TEST_CASE("a large semaphore request at the head is not overtaken by small ones") {
  auto loop = NewLoop();
  AsyncSemaphore sem(4);
  std::vector<int> order;
  auto take = [](AsyncSemaphore& s, std::vector<int>& o, int id, int n) -> Task<void> {
    co_await s.Acquire(n);
    o.push_back(id);
    s.Release(n);
  };
  auto body = [&](Loop& l) -> Task<void> {
    co_await sem.Acquire(3);  // 1 left
    auto big = take(sem, order, 1, 4);
    auto small = take(sem, order, 2, 1);
    auto release_later = [](Loop& l2, AsyncSemaphore& s) -> Task<void> {
      co_await l2.Sleep(std::chrono::milliseconds(1));
      s.Release(3);
    };
    co_await WhenAll(std::move(big), std::move(small), release_later(l, sem));
  };
  loop->Run(body(*loop));
  REQUIRE(order.size() == 2);
  CHECK(order[0] == 1);
  CHECK(order[1] == 2);
}

TEST_CASE("an async event wakes every waiter once set") {
  auto loop = NewLoop();
  AsyncEvent ev;
  int woke = 0;
  auto waiter = [](AsyncEvent& e, int& w) -> Task<void> {
    co_await e.Wait();
    ++w;
  };
  auto setter = [](Loop& l, AsyncEvent& e, int& w) -> Task<int> {
    co_await l.Sleep(std::chrono::milliseconds(1));
    int before = w;
    e.Set();
    co_return before;
  };
  auto [a, b, c, before] = loop->Run(WhenAll(waiter(ev, woke), waiter(ev, woke), waiter(ev, woke),
                                             setter(*loop, ev, woke)));
  (void)a, (void)b, (void)c;
  CHECK(before == 0);
  CHECK(woke == 3);
}

TEST_CASE("BlockOn runs a task on the loop thread from another thread") {
  auto lt = LoopThread::Start();
  REQUIRE(lt.ok());
  auto where = []() -> Task<std::thread::id> { co_return std::this_thread::get_id(); };
  CHECK((*lt)->loop().BlockOn(where()) == (*lt)->thread_id());
}

}  // namespace
}  // namespace ckptio::runtime
