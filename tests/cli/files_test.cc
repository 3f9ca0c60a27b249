// The CLI's input mappings: an input truncated while it is read ends the
// process with a message and exit status 1, not a crash (SIGBUS).

#include "cli/files.h"

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "test_util.h"

namespace ckptio::cli {
namespace {

struct ChildResult {
  int status = 0;
  std::string stderr_text;
};

// Runs `body` in a forked child with its stderr captured.
template <typename Body>
ChildResult InChild(Body body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    body();
    ::_exit(42);
  }
  ::close(fds[1]);
  ChildResult r;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) r.stderr_text.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  REQUIRE(::waitpid(pid, &r.status, 0) == pid);
  return r;
}

TEST_CASE("an input truncated while mapped ends the process with exit status 1 naming it, not SIGBUS") {
  testing::TempDir dir;
  const std::string path = dir / "input.safetensors";
  testing::WriteWholeFile(path, std::string(1 << 20, 'x'));
  ChildResult r = InChild([&] {
    auto file = MappedFile::Open(path);
    if (!file.ok()) ::_exit(3);
    std::filesystem::resize_file(path, 0);  // another process's truncate, as far as the mapping can tell
    volatile uint8_t byte = file->bytes()[512 << 10];
    (void)byte;
    ::_exit(4);  // not reached: the read above faults
  });
  CAPTURE(r.stderr_text);
  REQUIRE(WIFEXITED(r.status));
  CHECK(WEXITSTATUS(r.status) == 1);
  CHECK(r.stderr_text.find("ckptio: " + path + " shrank while it was being read") != std::string::npos);
  CHECK(r.stderr_text.find("nothing was committed") != std::string::npos);
}

TEST_CASE("a SIGBUS outside any input mapping stays a crash") {
  testing::TempDir dir;
  const std::string path = dir / "input.safetensors";
  testing::WriteWholeFile(path, "abcd");
  ChildResult r = InChild([&] {
    auto file = MappedFile::Open(path);  // installs the handler
    if (!file.ok()) ::_exit(3);
    ::raise(SIGBUS);  // si_addr is no input's
  });
  REQUIRE(WIFSIGNALED(r.status));
  CHECK(WTERMSIG(r.status) == SIGBUS);
}

}  // namespace
}  // namespace ckptio::cli
