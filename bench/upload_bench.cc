// bench/upload_bench: GCS resumable uploads through ckptio against `curl -T`,
// both to the same fast local sink (bench/http_sink, a separate process), over
// HTTP and HTTPS, with 1, 4 and 16 connections.
//
//   upload_bench [--size-gib G] [--quick] [--rounds R] [--chunk-mib M]
//                [--connections 1,4,16] [--schemes http,https] [--chunk-sweep]
//                [--sink PATH] [--curl PATH] [--only ckptio|curl]
//                [--verbose] [--nice N] [--loops K]
//
// Run it under `nice -n -5` (as root) on a shared machine: the sink and curl
// inherit the priority, and fewer runs lose the cores mid-way.
//
// ckptio: storage::GcsStorage's WriteFile, the path a save's shards take
// (gcs.loops event loops, resumable sessions, chunk_size as in Options::Gcs
// unless --chunk-mib), from a warm in-memory buffer, the bytes split across N
// objects uploaded at once over N connections. curl: N
// `curl -T` processes, each sending size/N bytes from a memfd. The limit: one
// connection from this process with no HTTP client at all, send() (or
// SSL_write) of the buffer in 1 MiB slices after a hand-written PUT head.
// All measured in the same run against the same sink: wall time and the
// client's CPU (user + system; ckptio and the limit: this process, which does
// nothing else meanwhile; curl: wait4() of each child). The sink's CPU is
// reported on its own.
//
// Prints markdown tables; ratios > 1 mean ckptio is faster / uses more CPU.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "bench_util.h"
#include "ckptio/options.h"
#include "runtime/task.h"
#include "runtime/when_all.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "http/http_client.h"
#include "runtime/loop.h"
#include "storage/gcs_storage.h"

extern char** environ;

namespace ckptio::bench {
namespace {

using runtime::Loop;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr double kGiB = double(uint64_t{1} << 30);

struct Args {
  double size_gib = 4;
  int rounds = 3;
  uint64_t chunk_mib = Options::Gcs{}.chunk_size >> 20;  // the library's default (16 MiB)
  std::vector<int> connections = {1, 4, 16};
  std::vector<std::string> schemes = {"http", "https"};
  bool chunk_sweep = false;
  bool verbose = false;  // every run on stderr
  std::string only;      // "ckptio" or "curl": run just that one (for profiling)
  int nice = 0;          // --nice: priority of the bench, the sink and curl
  int loops = Options::Gcs{}.loops;  // --loops: gcs.loops (the library's default unless given)
  std::string sink;  // default: http_sink next to this program
  std::string curl = "curl";
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

[[noreturn]] void Usage(int code) {
  std::fprintf(code == 0 ? stdout : stderr,
               "usage: upload_bench [--size-gib G] [--quick] [--rounds R] [--chunk-mib M]\n"
               "                    [--connections 1,4,16] [--schemes http,https] [--chunk-sweep]\n"
               "                    [--sink PATH] [--curl PATH] [--only ckptio|curl]\n"
               "                    [--verbose] [--nice N] [--loops K]\n");
  std::exit(code);
}

// A number given to `flag`, or exit with a message naming both.
double Number(const std::string& flag, const std::string& text, double min) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !(v >= min)) {
    std::fprintf(stderr, "upload_bench: %s wants a number >= %g, not \"%s\"\n", flag.c_str(), min, text.c_str());
    std::exit(1);
  }
  return v;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&] { return FlagValue("upload_bench", argc, argv, &i); };
    auto count = [&](double min) { return static_cast<int>(Number(s, next(), min)); };
    if (s == "--size-gib") a.size_gib = Number(s, next(), 1.0 / 64);
    else if (s == "--quick") a.size_gib = 0.25, a.rounds = 1;
    else if (s == "--rounds") a.rounds = count(1);
    else if (s == "--chunk-mib") a.chunk_mib = static_cast<uint64_t>(Number(s, next(), 1));
    else if (s == "--chunk-sweep") a.chunk_sweep = true;
    else if (s == "--verbose") a.verbose = true;
    else if (s == "--only") a.only = next();
    else if (s == "--nice") a.nice = static_cast<int>(Number(s, next(), -20));
    else if (s == "--loops") a.loops = count(1);
    else if (s == "--sink") a.sink = next();
    else if (s == "--curl") a.curl = next();
    else if (s == "--connections") {
      a.connections.clear();
      for (const std::string& c : Split(next())) a.connections.push_back(static_cast<int>(Number(s, c, 1)));
    } else if (s == "--schemes") {
      a.schemes = Split(next());
      for (const std::string& c : a.schemes) {
        if (c != "http" && c != "https") Usage(1);
      }
    } else Usage(s == "--help" ? 0 : 1);
  }
  if (!a.only.empty() && a.only != "ckptio" && a.only != "curl") Usage(1);
  if (a.sink.empty()) {
    a.sink = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "http_sink").string();
  }
  return a;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "upload_bench: %s\n", what.c_str());
  std::exit(2);
}

// Spawns argv without copying this process's page tables (posix_spawn uses
// vfork semantics: forking a process that holds a 4 GiB buffer would cost
// the parent tens of milliseconds per child, inside the timed region).
pid_t Spawn(const std::vector<std::string>& args, posix_spawn_file_actions_t* actions) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, argv[0], actions, nullptr, argv.data(), environ);
  if (rc != 0) Fail("cannot run " + args[0] + ": " + std::strerror(rc));
  return pid;
}

// The sink, a child process. It stops when we close its stdin.
class Sink {
 public:
  explicit Sink(const std::string& path) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) Fail("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    pid_ = Spawn({path}, &fa);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    stdin_ = in[1];
    FILE* f = ::fdopen(out[0], "r");
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      std::string l(line, std::strcspn(line, "\n"));
      if (l.rfind("http ", 0) == 0) http_port = std::stoi(l.substr(5));
      if (l.rfind("https ", 0) == 0) https_port = std::stoi(l.substr(6));
      if (l.rfind("tls ", 0) == 0) tls = l.substr(4);
      if (l.rfind("cert ", 0) == 0) {
        cert = l.substr(5);
        break;
      }
    }
    std::fclose(f);
    if (http_port == 0 || https_port == 0 || cert.empty()) Fail("the sink " + path + " did not start");
  }
  ~Sink() {
    ::close(stdin_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  std::string Url(const std::string& scheme) const {
    return scheme + "://127.0.0.1:" + std::to_string(scheme == "https" ? https_port : http_port);
  }
  // user + system CPU of the sink so far (all its threads), from /proc.
  double CpuSeconds() const {
    FILE* f = std::fopen(("/proc/" + std::to_string(pid_) + "/stat").c_str(), "r");
    if (f == nullptr) return 0;
    char buf[2048];
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* p = std::strrchr(buf, ')');
    unsigned long utime = 0, stime = 0;
    // After "(comm)": state is field 3; utime and stime are fields 14 and 15.
    const char* fields = "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu";
    if (p == nullptr || std::sscanf(p + 2, fields, &utime, &stime) != 2) {
      return 0;
    }
    return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
  }

  int http_port = 0;
  int https_port = 0;
  std::string cert;
  std::string tls;

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
};

// One timed upload.
struct Run {
  Rate client;
  double sink_cpu = 0;
};

// Medians of each figure over the rounds.
struct Summary {
  double gbps = 0;
  double cpu_per_gib = 0;
  double sink_cpu_per_gib = 0;
  double core_fraction = 0;
};

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

Summary Summarize(const std::vector<Run>& runs) {
  std::vector<double> g, c, s, f;
  for (const Run& r : runs) {
    g.push_back(r.client.gbps());
    c.push_back(r.client.cpu_per_gib());
    s.push_back(r.sink_cpu / (r.client.bytes / kGiB));
    f.push_back(r.client.core_fraction());
  }
  return {MedianOf(g), MedianOf(c), MedianOf(s), MedianOf(f)};
}

// ---- ckptio ----

// The path a save's shards take: storage::OpenGcsStorage (gcs.loops event
// loops: this one plus loops-1 threads, each with its share of
// gcs.connections), one CheckpointWriter, n FileImages written at once.
Task<Status> WriteImages(storage::Storage* storage, const std::vector<storage::FileImage>* images) {
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage->StartCheckpoint("upload_bench", /*replace=*/false, /*shared=*/false));
  std::vector<Task<Status>> writes;
  for (const storage::FileImage& image : *images) writes.push_back(writer->WriteFile(&image));
  std::vector<Status> done = co_await WhenAll(std::move(writes));
  for (Status& s : done) CO_TRY(s);  // each upload checked the size the sink stored
  co_return Status::Ok();
}

// n objects of size/n over n connections, on `loops` event loops.
Run RunCkptio(Loop& loop, const Sink& sink, const std::string& scheme, int n, int loops, uint64_t chunk,
              const char* data, uint64_t size) {
  Options::Gcs g;
  g.chunk_size = chunk;
  g.connections = n;
  g.loops = loops;
  if (scheme == "https") g.ca_file = sink.cert;
  // The emulator convention: this endpoint, no credentials.
  ::setenv("STORAGE_EMULATOR_HOST", sink.Url(scheme).c_str(), 1);
  auto opened = loop.Run(storage::OpenGcsStorage(loop, "gs://bench/upload_bench", g));
  if (!opened.ok()) Fail("open gs://bench on " + sink.Url(scheme) + ": " + opened.status().ToString());
  std::unique_ptr<storage::Storage> storage = std::move(opened).value();
  std::vector<storage::FileImage> images(static_cast<size_t>(n));
  const uint64_t part = size / n;
  for (int i = 0; i < n; ++i) {
    images[i].name = "object-" + std::to_string(i);
    images[i].size = part;
    images[i].segments = {{0, data + i * part, static_cast<size_t>(part), static_cast<size_t>(part)}};
  }
  Run run;
  const double sink0 = sink.CpuSeconds();
  Phase p;
  Status s = loop.Run(WriteImages(storage.get(), &images));
  run.client.seconds = p.wall();
  run.client.cpu = p.cpu();
  run.client.bytes = double(size);
  run.sink_cpu = sink.CpuSeconds() - sink0;
  if (!s.ok()) Fail("ckptio upload to " + sink.Url(scheme) + ": " + s.ToString());
  if (storage->retries() != 0) {
    std::fprintf(stderr, "note: %llu retries in a ckptio run\n", static_cast<unsigned long long>(storage->retries()));
  }
  return run;
}

// ---- curl ----

std::vector<std::string> CurlCommand(const Args& a, const Sink& sink, const std::string& scheme,
                                     const std::string& file) {
  std::vector<std::string> cmd = {a.curl, "-sS", "--fail", "-o", "/dev/null", "-T", file};
  if (scheme == "https") {
    cmd.push_back("--cacert");
    cmd.push_back(sink.cert);
  }
  cmd.push_back(sink.Url(scheme) + "/sink");
  return cmd;
}

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : " ") + s;
  return out;
}

Run RunCurl(const Args& a, const Sink& sink, const std::string& scheme, const std::vector<std::string>& files,
            uint64_t size) {
  Run run;
  const double sink0 = sink.CpuSeconds();
  auto t0 = Clock::now();
  std::vector<pid_t> pids;
  for (const std::string& f : files) {
    std::vector<std::string> cmd = CurlCommand(a, sink, scheme, f);
    pids.push_back(Spawn(cmd, nullptr));
  }
  for (pid_t pid : pids) {
    int status = 0;
    rusage ru{};
    if (::wait4(pid, &status, 0, &ru) != pid) Fail("wait4");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      Fail("curl failed: " + Join(CurlCommand(a, sink, scheme, files[0])));
    }
    auto tv = [](const timeval& t) { return double(t.tv_sec) + t.tv_usec / 1e6; };
    run.client.cpu += tv(ru.ru_utime) + tv(ru.ru_stime);
  }
  run.client.seconds = Seconds(Clock::now() - t0);
  run.client.bytes = double(size);
  run.sink_cpu = sink.CpuSeconds() - sink0;
  return run;
}

// The same bytes as the buffer in n memfds of size/n each, which curl reads
// as /dev/fd/<fd> (inherited: no O_CLOEXEC). tmpfs pages like a file in
// /dev/shm, but nothing is left behind if the benchmark dies.
class Parts {
 public:
  Parts(const char* data, uint64_t size, int n) {
    const uint64_t part = size / n;
    for (int i = 0; i < n; ++i) {
      const std::string name = "upload-bench-part-" + std::to_string(i);
      int fd = ::memfd_create(name.c_str(), 0);
      if (fd < 0) Fail("memfd_create " + name + ": " + std::strerror(errno));
      fds_.push_back(fd);
      const char* p = data + i * part;
      for (uint64_t left = part; left > 0;) {
        ssize_t w = ::write(fd, p, std::min<uint64_t>(left, 64 * kMiB));
        if (w <= 0) Fail("cannot write " + std::to_string(part) + " bytes to memfd " + name + ": " + std::strerror(errno));
        p += w;
        left -= static_cast<uint64_t>(w);
      }
      paths_.push_back("/dev/fd/" + std::to_string(fd));
    }
  }
  ~Parts() {
    for (int fd : fds_) ::close(fd);
  }
  Parts(const Parts&) = delete;
  Parts& operator=(const Parts&) = delete;
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  std::vector<int> fds_;
  std::vector<std::string> paths_;
};

// ---- the limit: one connection, no HTTP client ----

struct SslCtxDeleter {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslDeleter {
  void operator()(SSL* s) const { SSL_free(s); }
};

std::string OpenSslError() {
  char b[256] = "unknown error";
  if (unsigned long e = ERR_get_error()) ERR_error_string_n(e, b, sizeof b);
  ERR_clear_error();
  return b;
}

// One blocking connection to the sink, plain or TLS (verified against the
// sink's certificate, as curl and ckptio verify it).
class RawConn {
 public:
  RawConn(const Sink& sink, const std::string& scheme) {
    const int port = scheme == "https" ? sink.https_port : sink.http_port;
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      Fail("cannot connect to 127.0.0.1:" + std::to_string(port) + ": " + std::strerror(errno));
    }
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // as curl does
    if (scheme != "https") return;
    ctx_.reset(SSL_CTX_new(TLS_client_method()));
    if (!ctx_ || SSL_CTX_load_verify_locations(ctx_.get(), sink.cert.c_str(), nullptr) != 1) {
      Fail("cannot load the sink's certificate " + sink.cert + ": " + OpenSslError());
    }
    SSL_CTX_set_verify(ctx_.get(), SSL_VERIFY_PEER, nullptr);
    ssl_.reset(SSL_new(ctx_.get()));
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_.get()), "127.0.0.1");
    SSL_set_fd(ssl_.get(), fd_);
    if (SSL_connect(ssl_.get()) != 1) Fail("TLS handshake with the sink failed: " + OpenSslError());
    cipher_ = SSL_get_cipher_name(ssl_.get());
  }
  ~RawConn() {
    ssl_.reset();
    ::close(fd_);
  }
  void WriteAll(const char* p, size_t len) {
    while (len > 0) {
      const int n = ssl_ ? SSL_write(ssl_.get(), p, static_cast<int>(len))
                         : static_cast<int>(::send(fd_, p, len, MSG_NOSIGNAL));
      if (n <= 0) {
        if (!ssl_ && errno == EINTR) continue;
        Fail("raw upload: write to the sink failed: " + (ssl_ ? OpenSslError() : std::string(std::strerror(errno))));
      }
      p += n;
      len -= static_cast<size_t>(n);
    }
  }
  // The response head (the sink's answers have tiny bodies).
  std::string ReadHead() {
    std::string head;
    char b[4096];
    while (head.find("\r\n\r\n") == std::string::npos) {
      const int n = ssl_ ? SSL_read(ssl_.get(), b, sizeof b) : static_cast<int>(::recv(fd_, b, sizeof b, 0));
      if (n <= 0) Fail("raw upload: the sink closed the connection without an answer");
      head.append(b, static_cast<size_t>(n));
    }
    return head;
  }
  const std::string& cipher() const { return cipher_; }

 private:
  int fd_ = -1;
  std::unique_ptr<SSL_CTX, SslCtxDeleter> ctx_;
  std::unique_ptr<SSL, SslDeleter> ssl_;
  std::string cipher_;
};

// PUTs the buffer over one connection: a hand-written head, then the bytes
// straight from the buffer in 1 MiB writes (OpenSSL cuts them into 16 KiB
// records), then the answer. What any client must at least spend to move
// these bytes over this transport; setup and handshake are timed, as they
// are for curl and ckptio.
Run RunRaw(const Sink& sink, const std::string& scheme, const char* data, uint64_t size, std::string* cipher) {
  Run run;
  const double sink0 = sink.CpuSeconds();
  Phase p;
  {
    RawConn c(sink, scheme);
    const std::string head = "PUT /sink HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                             "Content-Length: " + std::to_string(size) + "\r\n\r\n";
    c.WriteAll(head.data(), head.size());
    for (uint64_t off = 0; off < size; off += kMiB) c.WriteAll(data + off, std::min<uint64_t>(kMiB, size - off));
    const std::string answer = c.ReadHead();
    if (answer.rfind("HTTP/1.1 200", 0) != 0) {
      Fail("raw upload to " + sink.Url(scheme) + ": " + answer.substr(0, answer.find('\r')));
    }
    if (cipher != nullptr) *cipher = c.cipher();
  }
  run.client.seconds = p.wall();
  run.client.cpu = p.cpu();
  run.client.bytes = double(size);
  run.sink_cpu = sink.CpuSeconds() - sink0;
  return run;
}

std::string Ratio(double a, double b) { return b > 0 ? Fmt("%.2fx", a / b) : "-"; }

// "curl 7.88.1 libcurl/7.88.1 OpenSSL/3.0.22" from `curl --version`.
std::string CurlVersion(const std::string& curl) {
  std::string line = RunCommand(curl + " --version");
  line = line.substr(0, line.find('\n'));
  std::stringstream ss(line);
  std::string out;
  for (std::string word; ss >> word;) {
    const bool version = out == "curl" && std::isdigit(static_cast<unsigned char>(word[0]));
    if (out.empty() || version || word.rfind("libcurl/", 0) == 0 || word.rfind("OpenSSL/", 0) == 0) {
      out += (out.empty() ? "" : " ") + word;
    }
  }
  return out;
}

std::string LoadAverage() {
  double l[3] = {0, 0, 0};
  if (getloadavg(l, 3) != 3) return "?";
  return Fmt("%.1f", l[0]) + " " + Fmt("%.1f", l[1]) + " " + Fmt("%.1f", l[2]);
}

// What every measurement shares.
struct Bench {
  const Args& args;
  Loop& loop;
  const Sink& sink;
  const char* data;
  uint64_t size;
};

// ckptio alone, for each chunk size: the round trip after every chunk costs
// throughput on one connection.
void PrintChunkSweep(const Bench& b) {
  Table t({"chunk size", "scheme", "connections", "ckptio GB/s", "ckptio CPU s/GiB"});
  for (const std::string& scheme : b.args.schemes) {
    for (int n : b.args.connections) {
      const uint64_t whole = b.size / n / kMiB;  // the whole object in one request
      for (uint64_t mib : {uint64_t{8}, uint64_t{16}, uint64_t{64}, uint64_t{256}, whole}) {
        std::vector<Run> runs;
        for (int r = 0; r < b.args.rounds; ++r) {
          runs.push_back(RunCkptio(b.loop, b.sink, scheme, n, b.args.loops, mib * kMiB, b.data, b.size));
        }
        Summary s = Summarize(runs);
        std::string label = std::to_string(mib) + " MiB" + (mib == whole ? " (whole object)" : "");
        t.Add({label, scheme, std::to_string(n), Fmt("%.3f", s.gbps), Fmt("%.3f", s.cpu_per_gib)});
      }
    }
  }
  t.Print();
  std::printf("\n");
}

struct Row {
  std::string scheme;
  int n;
  Summary ours, theirs;
};

void PrintRuns(const Bench& b, const std::string& scheme, int n, const std::vector<Run>& ours,
               const std::vector<Run>& theirs) {
  const double gib = double(b.size) / kGiB;
  for (size_t r = 0; r < ours.size(); ++r) {
    std::fprintf(stderr,
                 "%s n=%d round %zu: ckptio %.3f GB/s %.3f CPU s/GiB (sink %.3f)"
                 " | curl %.3f GB/s %.3f CPU s/GiB (sink %.3f)\n",
                 scheme.c_str(), n, r, ours[r].client.gbps(), ours[r].client.cpu_per_gib(), ours[r].sink_cpu / gib,
                 theirs[r].client.gbps(), theirs[r].client.cpu_per_gib(),
                 theirs[r].sink_cpu / gib);
  }
}

// The limit for a scheme: RunRaw, median of the rounds.
struct Limit {
  std::string scheme;
  Summary s;
  std::string cipher;  // negotiated, for HTTPS
};

std::vector<Limit> MeasureLimits(const Bench& b) {
  std::vector<Limit> limits;
  for (const std::string& scheme : b.args.schemes) {
    Limit l{scheme, {}, {}};
    std::vector<Run> runs;
    for (int r = 0; r < b.args.rounds; ++r) runs.push_back(RunRaw(b.sink, scheme, b.data, b.size, &l.cipher));
    if (b.args.verbose) {
      for (size_t r = 0; r < runs.size(); ++r) {
        std::fprintf(stderr, "%s limit round %zu: %.3f GB/s %.3f CPU s/GiB (sink %.3f)\n", scheme.c_str(), r,
                     runs[r].client.gbps(), runs[r].client.cpu_per_gib(), runs[r].sink_cpu / (b.size / kGiB));
      }
    }
    l.s = Summarize(runs);
    limits.push_back(l);
  }
  return limits;
}

// Every (connections, scheme) pair, ckptio and curl alternating within each
// round so that neither always runs right after the other.
std::vector<Row> MeasureRows(const Bench& b) {
  const bool run_ours = b.args.only != "curl", run_theirs = b.args.only != "ckptio";
  const uint64_t chunk = b.args.chunk_mib * kMiB;
  std::vector<Row> rows;
  for (int n : b.args.connections) {
    std::unique_ptr<Parts> parts;
    if (run_theirs) parts = std::make_unique<Parts>(b.data, b.size, n);
    for (const std::string& scheme : b.args.schemes) {
      std::vector<Run> ours, theirs;
      for (int r = 0; r < b.args.rounds; ++r) {
        auto ckptio = [&] { return RunCkptio(b.loop, b.sink, scheme, n, b.args.loops, chunk, b.data, b.size); };
        if (run_ours && r % 2 == 0) ours.push_back(ckptio());
        if (run_theirs) theirs.push_back(RunCurl(b.args, b.sink, scheme, parts->paths(), b.size));
        if (run_ours && r % 2 == 1) ours.push_back(ckptio());
        if (!run_ours) ours.push_back(theirs.back());
        if (!run_theirs) theirs.push_back(ours.back());
      }
      if (b.args.verbose) PrintRuns(b, scheme, n, ours, theirs);
      rows.push_back({scheme, n, Summarize(ours), Summarize(theirs)});
    }
  }
  return rows;
}

std::string SchemeLabel(const std::string& scheme) { return scheme == "https" ? "HTTPS" : "HTTP"; }

void PrintLimits(const std::vector<Limit>& limits) {
  Table t({"limit: one connection, no HTTP client", "GB/s", "CPU s/GiB", "% of a core", "sink CPU s/GiB"});
  for (const Limit& l : limits) {
    const std::string how = l.scheme == "https" ? "SSL_write of 1 MiB slices (" + l.cipher + ")" : "send() of 1 MiB slices";
    t.Add({SchemeLabel(l.scheme) + ": " + how, Fmt("%.3f", l.s.gbps), Fmt("%.3f", l.s.cpu_per_gib),
           Fmt("%.0f%%", 100 * l.s.core_fraction), Fmt("%.3f", l.s.sink_cpu_per_gib)});
  }
  t.Print();
  std::printf("\n");
}

// The table, then the targets: CPU per byte <= 1.1x curl's on every row;
// with 4+ connections, throughput >= 0.9x that of 4 parallel curl uploads.
void PrintResults(const Bench& b, const std::vector<Limit>& limits, const std::vector<Row>& rows) {
  auto curl4 = [&](const std::string& scheme) -> double {
    for (const Row& r : rows) {
      if (r.scheme == scheme && r.n == 4) return r.theirs.gbps;
    }
    return 0;
  };
  auto limit = [&](const std::string& scheme) -> double {
    for (const Limit& l : limits) {
      if (l.scheme == scheme) return l.s.gbps;
    }
    return 0;
  };
  Table t({"upload", "ckptio GB/s", "curl GB/s", "ckptio / curl", "ckptio / 4 curls", "ckptio / limit",
           "ckptio CPU s/GiB", "curl CPU s/GiB", "CPU ratio", "ckptio / curl % of a core",
           "sink CPU s/GiB (ckptio / curl)"});
  bool cpu_ok = true, tput_ok = true, have_curl4 = true;
  std::string misses;
  for (const Row& r : rows) {
    std::string label = SchemeLabel(r.scheme) + ", " + std::to_string(r.n) + (r.n == 1 ? " connection" : " connections");
    const double cpu_ratio = r.ours.cpu_per_gib / r.theirs.cpu_per_gib;
    const double ref = r.n >= 4 ? curl4(r.scheme) : 0;
    if (r.n >= 4 && ref == 0) have_curl4 = false;
    t.Add({label, Fmt("%.3f", r.ours.gbps), Fmt("%.3f", r.theirs.gbps), Ratio(r.ours.gbps, r.theirs.gbps),
           r.n >= 4 ? Ratio(r.ours.gbps, ref) : "-", Ratio(r.ours.gbps, limit(r.scheme)),
           Fmt("%.3f", r.ours.cpu_per_gib), Fmt("%.3f", r.theirs.cpu_per_gib), Fmt("%.2fx", cpu_ratio),
           Fmt("%.0f%%", 100 * r.ours.core_fraction) + " / " + Fmt("%.0f%%", 100 * r.theirs.core_fraction),
           Fmt("%.3f", r.ours.sink_cpu_per_gib) + " / " + Fmt("%.3f", r.theirs.sink_cpu_per_gib)});
    if (cpu_ratio > 1.1) {
      cpu_ok = false;
      misses += "\n  - CPU: " + label + " " + Fmt("%.2fx", cpu_ratio);
    }
    if (ref > 0 && r.ours.gbps < 0.9 * ref) {
      tput_ok = false;
      misses += "\n  - throughput: " + label + " " + Ratio(r.ours.gbps, ref) + " of 4 curls";
    }
  }
  t.Print();
  std::printf("\nckptio: storage::GcsStorage, as a save writes its shards: the buffer split into N objects written "
              "at once through one CheckpointWriter (resumable sessions, chunk_size %llu MiB, no auth), "
              "gcs.connections = N, gcs.loops = %d (event loops carrying the uploads, %d of them on threads of "
              "their own); CPU = this process's user+sys.\n",
              static_cast<unsigned long long>(b.args.chunk_mib), b.args.loops, b.args.loops - 1);
  std::printf("curl: N processes at once, each `%s` for a memfd of size/N (tmpfs pages); CPU = user+sys of the "
              "children (wait4).\n",
              Join(CurlCommand(b.args, b.sink, "https", "/dev/fd/N")).c_str());
  std::printf("HTTP rows use the same command without --cacert and with http://. Sink CPU: the sink process's "
              "during the run (in neither client's figures). \"ckptio / 4 curls\": ckptio's GB/s over that of 4 "
              "parallel curl uploads; \"ckptio / limit\": over the one-connection limit above.\n\n");
  const char* tput = !have_curl4 ? "not measured (needs --connections with 4)" : tput_ok ? "met" : "NOT met";
  std::printf("Targets:\n- CPU per byte <= 1.1x curl's (every row): %s\n"
              "- with 4+ connections, throughput >= 0.9x that of 4 parallel curl uploads: %s%s\n",
              cpu_ok ? "met" : "NOT met", tput, misses.c_str());
  std::printf("\nReading the figures: every client and the sink share this machine's cores (and, on a shared "
              "machine, everyone else's work). A \"%% of a core\" well below 100%% means the run waited for the "
              "scheduler or for the other side, not for its own CPU: GB/s then measures the machine's load more "
              "than the client, and CPU s/GiB (which counts only work done) is the steadier figure. ckptio sends "
              "no x-goog-hash here (the pipeline computes the CRC32C during the snapshot) and the sink computes "
              "none (GCS does, on its own CPU).\n");
}

}  // namespace
}  // namespace ckptio::bench

int main(int argc, char** argv) {
  using namespace ckptio::bench;
  Args args = ParseArgs(argc, argv);
  if (args.nice != 0 && setpriority(PRIO_PROCESS, 0, args.nice) != 0) {
    std::fprintf(stderr, "upload_bench: cannot set nice %d: %s\n", args.nice, std::strerror(errno));
  }
  // A multiple of 16 MiB, so that 1, 4 and 16 objects split it evenly.
  const uint64_t size = std::max<uint64_t>(1, uint64_t(args.size_gib * 64)) * 16 * kMiB;
  auto loop_or = ckptio::runtime::Loop::Create();
  if (!loop_or.ok()) Fail(loop_or.status().ToString());
  Sink sink(args.sink);
  AlignedBuffer buf = WarmBuffer(size, 11);
  const Bench b{args, **loop_or, sink, buf.get(), size};
  std::string command = "upload_bench";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  std::printf("## Upload benchmark: ckptio (GcsStorage) vs curl -T\n\n`%s`\n\n%s; %s; nice %d\n",
              command.c_str(), MachineLine().c_str(), CurlVersion(args.curl).c_str(), getpriority(PRIO_PROCESS, 0));
  std::printf("%.2f GiB per upload, median of %d rounds; sink: bench/http_sink (separate process, %s); "
              "load average at start %s\n\n",
              double(size) / kGiB, args.rounds, sink.tls.c_str(), LoadAverage().c_str());
  if (args.chunk_sweep) PrintChunkSweep(b);
  auto t0 = Clock::now();
  const std::vector<Limit> limits = MeasureLimits(b);
  PrintLimits(limits);
  const std::vector<Row> rows = MeasureRows(b);
  PrintResults(b, limits, rows);
  std::printf("\nThe measured rows took %.0f s; load average at the end %s.\n", Seconds(Clock::now() - t0),
              LoadAverage().c_str());
  return 0;
}
