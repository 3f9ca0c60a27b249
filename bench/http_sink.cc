// bench/http_sink: a fast local HTTP/1.1 sink for the upload benchmark.
//
//   http_sink [--dir DIR] [--low-water BYTES]
//
// Listens on two ephemeral ports of 127.0.0.1, one plain HTTP and one HTTPS
// with a self-signed certificate (EC P-256, SAN IP:127.0.0.1) it makes at
// start-up and writes to DIR/cert.pem (DIR: a new directory under /tmp unless
// given; a temporary one is removed on exit). Prints
//
//   http <port>
//   https <port>
//   tls <protocol and the cipher suite it prefers>
//   cert <path>
//
// on stdout, then serves until stdin reaches EOF or SIGINT/SIGTERM arrives, so
// a parent that holds the write end of our stdin stops us by closing it (or by
// dying).
//
// What it serves: request bodies (Content-Length only) are read and thrown
// away as cheaply as the kernel allows (plain: recv(MSG_TRUNC), which drops
// the bytes without copying them to user space; TLS: decrypt into one large
// scratch buffer). Keep-alive; one thread per connection. Routes:
//   POST /upload/storage/v1/b/B/o?uploadType=resumable&name=N
//        -> 200, Location: <scheme>://127.0.0.1:<port>/upload/session/<id>
//   PUT  /upload/session/<id>, Content-Range: bytes a-b/*   -> 308, Range: bytes=0-b
//                              Content-Range: bytes a-b/T   -> 200 {"name","bucket","size"}
//                              Content-Range: bytes */T     -> 308 / 200 (a status query)
//   POST /upload/storage/v1/b/B/o?uploadType=media&name=N   -> 200 {...}
//   PUT or POST anything else (what `curl -T` sends)        -> 200
// It answers `Expect: 100-continue` at once, as a real server does.
//
// The sink shares the machine's cores with the client being measured, so it
// does as little as it can; the benchmark reports its CPU separately.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kHeadBuffer = 64 * 1024;     // request line + headers (+ the start of a body)
constexpr size_t kScratch = 1 << 20;          // TLS plaintext goes here to be forgotten
constexpr size_t kMaxHead = kHeadBuffer - 1;  // a longer head is refused
constexpr int kTlsReadBuffer = 256 * 1024;    // ciphertext read per recv()
uint64_t g_low_water = 1 << 20;               // --low-water: SO_RCVLOWAT cap for bodies

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "http_sink: %s\n", what.c_str());
  ERR_print_errors_fp(stderr);
  std::exit(1);
}

// ---- connections: plain or TLS, the same three operations ----

class Conn {
 public:
  virtual ~Conn() = default;
  // Up to len bytes into buf: >0 bytes read, 0 at EOF, <0 on error.
  virtual long Read(char* buf, size_t len) = 0;
  // Reads up to len bytes and drops them; same return convention.
  virtual long Discard(size_t len) = 0;
  virtual bool WriteAll(std::string_view s) = 0;
  // At least `bytes_coming` more bytes will arrive before the client waits
  // for our answer (0: a head is next). Sets SO_RCVLOWAT so that a blocking
  // read wakes up only once a large batch has arrived: fewer wake-ups of
  // the sink, and fewer cross-CPU wake-ups (IPIs, costly in a VM) that the
  // client pays for too. Half of what is coming, because a read that has
  // already copied X bytes sleeps until SO_RCVLOWAT *new* bytes are queued:
  // X < lowat and lowat <= coming/2 guarantee they come.
  virtual void ExpectBody(uint64_t bytes_coming) = 0;

 protected:
  void SetLowWater(int fd, uint64_t bytes_coming) {
    int v = static_cast<int>(std::clamp<uint64_t>(bytes_coming / 2, 1, g_low_water));
    if (v == low_water_) return;
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
    low_water_ = v;
  }

 private:
  int low_water_ = 1;
};

class PlainConn final : public Conn {
 public:
  explicit PlainConn(int fd) : fd_(fd) {}
  ~PlainConn() override { ::close(fd_); }
  long Read(char* buf, size_t len) override { return Retry([&] { return ::recv(fd_, buf, len, 0); }); }
  long Discard(size_t len) override {
    // TCP: MSG_TRUNC drops the bytes in the kernel without copying them out.
    len = std::min<size_t>(len, size_t{1} << 30);
    return Retry([&] { return ::recv(fd_, nullptr, len, MSG_TRUNC); });
  }
  void ExpectBody(uint64_t body_left) override { SetLowWater(fd_, body_left); }
  bool WriteAll(std::string_view s) override {
    while (!s.empty()) {
      ssize_t n = Retry([&] { return ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL); });
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

 private:
  template <typename F>
  static long Retry(F f) {
    for (;;) {
      ssize_t n = f();
      if (n >= 0 || errno != EINTR) return n;
    }
  }
  int fd_;
};

class TlsConn final : public Conn {
 public:
  TlsConn(SSL* ssl, int fd) : ssl_(ssl), fd_(fd), scratch_(new char[kScratch]) {}
  ~TlsConn() override {
    SSL_free(ssl_);
    ::close(fd_);
  }
  long Read(char* buf, size_t len) override {
    int n = SSL_read(ssl_, buf, static_cast<int>(std::min<size_t>(len, INT32_MAX)));
    return n > 0 ? n : (SSL_get_error(ssl_, n) == SSL_ERROR_ZERO_RETURN ? 0 : -1);
  }
  long Discard(size_t len) override { return Read(scratch_.get(), std::min(len, kScratch)); }
  // Ciphertext is longer than plaintext, but up to a record of it may
  // already sit in OpenSSL's hands, so wait for that much less.
  void ExpectBody(uint64_t body_left) override {
    constexpr uint64_t kRecord = 17 * 1024;
    SetLowWater(fd_, body_left > kRecord ? body_left - kRecord : 1);
  }
  bool WriteAll(std::string_view s) override {
    while (!s.empty()) {
      int n = SSL_write(ssl_, s.data(), static_cast<int>(s.size()));
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

 private:
  SSL* ssl_;
  int fd_;
  std::unique_ptr<char[]> scratch_;
};

// ---- requests ----

struct Head {
  std::string method;
  std::string target;
  uint64_t content_length = 0;
  std::string content_range;
  bool expect_continue = false;
  bool close = false;
  bool chunked = false;
};

bool IEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::optional<Head> ParseHead(std::string_view text) {
  Head h;
  size_t eol = text.find("\r\n");
  std::string_view line = text.substr(0, eol);
  size_t sp1 = line.find(' ');
  size_t sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp2 == sp1) return std::nullopt;
  h.method = line.substr(0, sp1);
  h.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  text.remove_prefix(eol + 2);
  while (!text.empty()) {
    eol = text.find("\r\n");
    line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 2);
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view name = Trim(line.substr(0, colon));
    std::string_view value = Trim(line.substr(colon + 1));
    if (IEquals(name, "content-length")) {
      auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), h.content_length);
      if (ec != std::errc() || end != value.data() + value.size()) return std::nullopt;  // 400
    } else if (IEquals(name, "content-range")) {
      h.content_range = value;
    } else if (IEquals(name, "expect")) {
      h.expect_continue = IEquals(value, "100-continue");
    } else if (IEquals(name, "connection")) {
      h.close = IEquals(value, "close");
    } else if (IEquals(name, "transfer-encoding")) {
      h.chunked = !IEquals(value, "identity");
    }
  }
  return h;
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      unsigned v = 0;
      std::from_chars(s.data() + i + 1, s.data() + i + 3, v, 16);
      out += static_cast<char>(v);
      i += 2;
    } else {
      out += s[i] == '+' ? ' ' : s[i];
    }
  }
  return out;
}

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string QueryParam(std::string_view target, std::string_view key) {
  size_t q = target.find('?');
  if (q == std::string_view::npos) return "";
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view kv = query.substr(0, amp);
    query.remove_prefix(amp == std::string_view::npos ? query.size() : amp + 1);
    size_t eq = kv.find('=');
    if (kv.substr(0, eq) == key) return eq == std::string_view::npos ? "" : PercentDecode(kv.substr(eq + 1));
  }
  return "";
}

std::string Reply(int code, std::string_view reason, const std::vector<std::string>& headers, std::string_view body) {
  std::string r = "HTTP/1.1 " + std::to_string(code) + " " + std::string(reason) + "\r\n";
  for (const auto& h : headers) r += h + "\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  if (!body.empty()) r += "Content-Type: application/json; charset=UTF-8\r\n";
  r += "\r\n";
  r += body;
  return r;
}

std::string BadRequest(std::string_view message) {
  return Reply(400, "Bad Request", {}, "{\"error\": {\"message\": " + JsonString(message) + "}}");
}

std::string ObjectJson(const std::string& bucket, const std::string& name, uint64_t size) {
  return "{\"kind\": \"storage#object\", \"bucket\": " + JsonString(bucket) + ", \"name\": " + JsonString(name) +
         ", \"size\": \"" + std::to_string(size) + "\", \"generation\": \"1\"}";
}

// ---- resumable sessions, shared by all connections ----

struct Session {
  std::string bucket;
  std::string name;
  uint64_t committed = 0;  // bytes [0, committed) received
  bool done = false;
};

class Sessions {
 public:
  uint64_t Start(std::string bucket, std::string name) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = ++next_;
    sessions_[id] = Session{std::move(bucket), std::move(name)};
    return id;
  }
  // Applies a PUT of `body` bytes with this Content-Range; returns the reply.
  std::string Put(uint64_t id, std::string_view range, uint64_t body) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return Reply(404, "Not Found", {}, R"({"error": {"message": "no such session"}})");
    Session& s = it->second;
    // "bytes a-b/T", "bytes a-b/*", "bytes */T", "bytes */*"
    if (range.rfind("bytes ", 0) != 0) return BadRequest("bad Content-Range");
    range.remove_prefix(6);
    size_t slash = range.find('/');
    std::string_view span = range.substr(0, slash);
    std::string_view total_text = slash == std::string_view::npos ? "*" : range.substr(slash + 1);
    std::optional<uint64_t> total;
    if (total_text != "*") {
      uint64_t t = 0;
      std::from_chars(total_text.data(), total_text.data() + total_text.size(), t);
      total = t;
    }
    if (span != "*") {
      uint64_t a = 0, b = 0;
      size_t dash = span.find('-');
      if (dash == std::string_view::npos) return BadRequest("bad Content-Range");
      std::from_chars(span.data(), span.data() + dash, a);
      std::from_chars(span.data() + dash + 1, span.data() + span.size(), b);
      if (b < a || b - a + 1 != body || a > s.committed) {
        return BadRequest("Content-Range does not match the body or leaves a gap");
      }
      s.committed = std::max(s.committed, b + 1);
    } else if (body != 0) {
      return BadRequest("a status query has no body");
    }
    if (total && s.committed == *total) s.done = true;
    if (s.done) return Reply(200, "OK", {}, ObjectJson(s.bucket, s.name, s.committed));
    std::vector<std::string> h;
    if (s.committed > 0) h.push_back("Range: bytes=0-" + std::to_string(s.committed - 1));
    return Reply(308, "Resume Incomplete", h, "");
  }

 private:
  std::mutex mu_;
  uint64_t next_ = 0;
  std::unordered_map<uint64_t, Session> sessions_;
};

Sessions g_sessions;

struct Listener {
  std::string scheme;
  int port = 0;
  int fd = -1;
  SSL_CTX* tls = nullptr;  // null for plain http
};

std::string Route(const Listener& l, const Head& h, uint64_t body) {
  std::string_view path = std::string_view(h.target).substr(0, h.target.find('?'));
  constexpr std::string_view kUpload = "/upload/storage/v1/b/";
  constexpr std::string_view kSession = "/upload/session/";
  if (h.method == "POST" && path.rfind(kUpload, 0) == 0) {
    std::string_view rest = path.substr(kUpload.size());
    std::string bucket = PercentDecode(rest.substr(0, rest.find('/')));
    std::string name = QueryParam(h.target, "name");
    std::string type = QueryParam(h.target, "uploadType");
    if (type == "resumable") {
      uint64_t id = g_sessions.Start(bucket, name);
      std::string location = "Location: " + l.scheme + "://127.0.0.1:" + std::to_string(l.port) +
                             std::string(kSession) + std::to_string(id);
      return Reply(200, "OK", {location}, "");
    }
    return Reply(200, "OK", {}, ObjectJson(bucket, name, body));
  }
  if (h.method == "PUT" && path.rfind(kSession, 0) == 0) {
    uint64_t id = 0;
    std::string_view rest = path.substr(kSession.size());
    std::from_chars(rest.data(), rest.data() + rest.size(), id);
    return g_sessions.Put(id, h.content_range, body);
  }
  if (h.method == "PUT" || h.method == "POST") {
    return Reply(200, "OK", {}, "{\"received\": " + std::to_string(body) + "}");
  }
  return Reply(404, "Not Found", {}, R"({"error": {"message": "not found"}})");
}

// Serves one connection until the peer closes it or breaks the protocol.
void Serve(const Listener& l, std::unique_ptr<Conn> c) {
  std::unique_ptr<char[]> buf(new char[kHeadBuffer]);
  size_t have = 0;  // bytes in buf not yet consumed
  for (;;) {
    // Read until the end of the head.
    size_t end = std::string_view::npos;
    c->ExpectBody(0);
    for (;;) {
      end = std::string_view(buf.get(), have).find("\r\n\r\n");
      if (end != std::string_view::npos) break;
      if (have == kMaxHead) return;  // head too long: drop the connection
      long n = c->Read(buf.get() + have, kMaxHead - have);
      if (n <= 0) return;
      have += static_cast<size_t>(n);
    }
    std::optional<Head> h = ParseHead(std::string_view(buf.get(), end + 2));
    size_t head_len = end + 4;
    if (!h || h->chunked) {
      const std::string why = h ? "chunked request bodies are not supported (send Content-Length)"
                                : "cannot parse the request line or Content-Length";
      c->WriteAll(Reply(h ? 501 : 400, h ? "Not Implemented" : "Bad Request", {"Connection: close"},
                        "{\"error\": {\"message\": " + JsonString(why) + "}}"));
      return;
    }
    if (h->expect_continue && !c->WriteAll("HTTP/1.1 100 Continue\r\n\r\n")) return;
    // The body: first what is already buffered, then straight from the socket.
    uint64_t buffered = std::min<uint64_t>(have - head_len, h->content_length);
    uint64_t left = h->content_length - buffered;
    size_t consumed = head_len + static_cast<size_t>(buffered);
    std::memmove(buf.get(), buf.get() + consumed, have - consumed);
    have -= consumed;
    while (left > 0) {
      c->ExpectBody(left);
      long n = c->Discard(left);
      if (n <= 0) return;
      left -= static_cast<uint64_t>(n);
    }
    if (!c->WriteAll(Route(l, *h, h->content_length)) || h->close) return;
  }
}

void Accept(const Listener* l) {
  for (;;) {
    int fd = ::accept4(l->fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      Die(std::string("accept: ") + std::strerror(errno));
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::thread([l, fd] {
      std::unique_ptr<Conn> c;
      if (l->tls == nullptr) {
        c = std::make_unique<PlainConn>(fd);
      } else {
        SSL* ssl = SSL_new(l->tls);
        // Reads go through a 256 KiB buffer BIO: one recv() for many records,
        // and OpenSSL still reads record by record from memory. (Its own
        // read_ahead moves the unread rest of its buffer to the front before
        // every record: with a large buffer that memmove was 20% of the
        // sink's CPU.) Writes go straight to the socket, unbuffered.
        BIO* sock_in = BIO_new_socket(fd, BIO_NOCLOSE);
        BIO* in = BIO_new(BIO_f_buffer());
        BIO_set_read_buffer_size(in, kTlsReadBuffer);
        BIO_push(in, sock_in);
        SSL_set_bio(ssl, in, BIO_new_socket(fd, BIO_NOCLOSE));
        auto tc = std::make_unique<TlsConn>(ssl, fd);
        if (SSL_accept(ssl) != 1) {
          ERR_clear_error();
          return;
        }
        c = std::move(tc);
      }
      Serve(*l, std::move(c));
    }).detach();
  }
}

int ListenLocal(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) Die(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    Die(std::string("cannot listen on 127.0.0.1: ") + std::strerror(errno));
  }
  *port = ntohs(a.sin_port);
  return fd;
}

// ---- the certificate ----

void AddExt(X509* x, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, x, x, nullptr, nullptr, 0);
  X509_EXTENSION* e = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (e == nullptr || X509_add_ext(x, e, -1) != 1) Die(std::string("cannot add certificate extension ") + value);
  X509_EXTENSION_free(e);
}

// A self-signed certificate for 127.0.0.1, written to cert_path; returns a
// server context using it.
SSL_CTX* MakeTlsContext(const std::string& cert_path) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* x = X509_new();
  if (key == nullptr || x == nullptr) Die("cannot make a key");
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), static_cast<long>(::getpid()) * 7919 + ::time(nullptr) % 100000);
  X509_gmtime_adj(X509_getm_notBefore(x), -3600);
  X509_gmtime_adj(X509_getm_notAfter(x), 7 * 86400);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("127.0.0.1"), -1, -1, 0);
  X509_set_issuer_name(x, name);
  AddExt(x, NID_basic_constraints, "critical,CA:TRUE");
  AddExt(x, NID_subject_key_identifier, "hash");
  AddExt(x, NID_subject_alt_name, "IP:127.0.0.1");
  if (X509_sign(x, key, EVP_sha256()) == 0) Die("cannot sign the certificate");
  FILE* f = std::fopen(cert_path.c_str(), "w");
  if (f == nullptr || PEM_write_X509(f, x) != 1 || std::fclose(f) != 0) Die("cannot write " + cert_path);

  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr || SSL_CTX_use_certificate(ctx, x) != 1 || SSL_CTX_use_PrivateKey(ctx, key) != 1) {
    Die("cannot set up TLS");
  }
  // What Google's front ends pick for a client with AES-NI.
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");
  SSL_CTX_set_options(ctx, SSL_OP_CIPHER_SERVER_PREFERENCE);
  X509_free(x);
  EVP_PKEY_free(key);
  return ctx;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--low-water" && i + 1 < argc) {
      g_low_water = std::max<uint64_t>(1, std::stoull(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: http_sink [--dir DIR] [--low-water BYTES]\n");
      return a == "--help" ? 0 : 1;
    }
  }
  bool temporary = dir.empty();
  if (temporary) {
    char tmpl[] = "/tmp/ckptio-sink-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) Die(std::string("mkdtemp: ") + std::strerror(errno));
    dir = tmpl;
  } else {
    std::filesystem::create_directories(dir);
  }
  // Signals are taken by signalfd below, in the main thread only.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const std::string cert = dir + "/cert.pem";
  static Listener plain{"http"}, tls{"https"};
  plain.fd = ListenLocal(&plain.port);
  tls.fd = ListenLocal(&tls.port);
  tls.tls = MakeTlsContext(cert);
  std::thread(Accept, &plain).detach();
  std::thread(Accept, &tls).detach();
  std::printf("http %d\nhttps %d\ntls TLSv1.3, TLS_AES_128_GCM_SHA256 preferred\ncert %s\n", plain.port, tls.port,
              cert.c_str());
  std::fflush(stdout);

  int sfd = ::signalfd(-1, &stop, SFD_CLOEXEC);
  pollfd p[2] = {{STDIN_FILENO, POLLIN, 0}, {sfd, POLLIN, 0}};
  char junk[256];
  for (;;) {
    if (::poll(p, 2, -1) < 0) continue;
    if (p[1].revents) break;
    if (p[0].revents && ::read(STDIN_FILENO, junk, sizeof junk) <= 0) break;
  }
  if (temporary) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::fflush(stdout);
  ::_exit(0);  // detached connection threads end with the process
}
