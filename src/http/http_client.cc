#include "http/http_client.h"

#include <curl/curl.h>
#include <linux/time_types.h>
#include <poll.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <mutex>

#include "base/status_macros.h"
#include "http/ca_bundle.h"
#include "runtime/io_ops.h"

namespace ckptio::http {
namespace {

using runtime::IoOp;
using runtime::Loop;

std::once_flag g_curl_init;

struct SlistDeleter {
  void operator()(curl_slist* l) const { curl_slist_free_all(l); }
};
struct EasyDeleter {
  void operator()(CURL* e) const { curl_easy_cleanup(e); }
};
using UniqueSlist = std::unique_ptr<curl_slist, SlistDeleter>;
using UniqueEasy = std::unique_ptr<CURL, EasyDeleter>;

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::string_view Response::Header(std::string_view lower_name) const {
  for (const auto& [k, v] : headers) {
    if (k == lower_name) return v;
  }
  return {};
}

Status CurlCodeToStatus(int code, std::string_view what, std::string_view error_buffer) {
  if (code == CURLE_OK) return Status::Ok();
  std::string m(what);
  m += ": ";
  m += curl_easy_strerror(static_cast<CURLcode>(code));
  if (!error_buffer.empty()) {
    m += " (";
    m += error_buffer;
    m += ")";
  }
  switch (code) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_SEND_FAIL_REWIND:
      return UnavailableError(std::move(m));
    case CURLE_OPERATION_TIMEDOUT:
      return DeadlineExceededError(std::move(m));
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
      return FailedPreconditionError(std::move(m));
    case CURLE_URL_MALFORMAT:
    case CURLE_UNSUPPORTED_PROTOCOL:
      return InvalidArgumentError(std::move(m));
    case CURLE_WRITE_ERROR:
      return CorruptionError(std::move(m));
    default:
      return IoError(std::move(m));
  }
}

// ---------------------------------------------------------------------------

class HttpClient::Impl {
 public:
  Impl(Loop& loop, HttpOptions options) : loop_(loop), options_(std::move(options)) {}
  ~Impl();
  Status Init();
  Task<Result<Response>> Send(Request request);
  HttpStats stats;

 private:
  // One socket curl wants watched. Its own IoOp: at most one poll in flight.
  // It outlives curl's interest in the socket until that poll completes, so
  // a late completion never touches a reused descriptor's state.
  struct SocketState : IoOp {
    Impl* impl = nullptr;
    curl_socket_t fd = CURL_SOCKET_BAD;
    unsigned wanted = 0;      // POLLIN / POLLOUT curl asked for
    unsigned armed_mask = 0;  // what the poll in flight waits for
    bool armed = false;
    bool removed = false;     // curl is done with it: delete when idle
    bool dispatching = false; // inside our completion handler
  };
  struct TimerOp : IoOp {
    Impl* impl = nullptr;
    __kernel_timespec ts{};
  };
  struct Transfer;
  class TransferAwaiter;

  static int OnSocket(CURL* easy, curl_socket_t fd, int what, void* userp, void* socketp);
  static int OnTimer(CURLM* multi, long timeout_ms, void* userp);
  static void OnPollDone(IoOp* op, int res, uint32_t flags);
  static void OnTimerDone(IoOp* op, int res, uint32_t flags);
  static size_t OnRead(char* buf, size_t size, size_t n, void* userp);
  static int OnSeek(void* userp, curl_off_t offset, int origin);
  static size_t OnWrite(char* data, size_t size, size_t n, void* userp);
  static size_t OnHeader(char* data, size_t size, size_t n, void* userp);
  static int OnProgress(void* userp, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow);

  void Arm(SocketState* s);
  void Act(curl_socket_t fd, int ev_bitmask);
  void DrainMessages();
  Status Configure(Transfer* t);

  Loop& loop_;
  HttpOptions options_;
  CURLM* multi_ = nullptr;
  TimerOp* timer_ = nullptr;  // the armed timer, if any; the only one with impl set
};

struct HttpClient::Impl::Transfer {
  Request* request = nullptr;
  Response response;
  UniqueEasy easy;
  UniqueSlist headers;
  char error[CURL_ERROR_SIZE] = {};
  uint64_t body_size = 0;
  uint64_t read_pos = 0;   // request body bytes handed to curl
  bool overflow = false;   // the response did not fit response_buffer (or max_body)
  bool stalled = false;    // aborted: no byte moved for stall_timeout
  curl_off_t last_up = -1;
  curl_off_t last_down = -1;
  std::chrono::steady_clock::time_point last_progress;
  std::chrono::milliseconds stall_timeout{0};
  CURLcode result = CURLE_OK;
  std::coroutine_handle<> waiter;
};

class HttpClient::Impl::TransferAwaiter {
 public:
  TransferAwaiter(Impl* impl, Transfer* t) : impl_(impl), t_(t) {}
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    t_->waiter = h;
    CURLMcode rc = curl_multi_add_handle(impl_->multi_, t_->easy.get());
    if (rc != CURLM_OK) {
      t_->result = CURLE_FAILED_INIT;
      std::snprintf(t_->error, sizeof t_->error, "curl_multi_add_handle: %s", curl_multi_strerror(rc));
      return false;
    }
    return true;
  }
  void await_resume() const noexcept {}

 private:
  Impl* impl_;
  Transfer* t_;
};

HttpClient::Impl::~Impl() {
  if (multi_ == nullptr) return;
  curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, nullptr);
  // Closing pooled connections calls OnSocket(REMOVE), which cancels their
  // polls; the states free themselves when the cancellations complete.
  curl_multi_cleanup(multi_);
  if (timer_ != nullptr) {
    timer_->impl = nullptr;
    loop_.Cancel(timer_);
  }
}

Status HttpClient::Impl::Init() {
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  multi_ = curl_multi_init();
  if (multi_ == nullptr) return InternalError("curl_multi_init failed");
  curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, &Impl::OnSocket);
  curl_multi_setopt(multi_, CURLMOPT_SOCKETDATA, this);
  curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, &Impl::OnTimer);
  curl_multi_setopt(multi_, CURLMOPT_TIMERDATA, this);
  curl_multi_setopt(multi_, CURLMOPT_MAX_TOTAL_CONNECTIONS, static_cast<long>(options_.max_connections));
  curl_multi_setopt(multi_, CURLMOPT_MAX_HOST_CONNECTIONS, static_cast<long>(options_.max_connections));
  curl_multi_setopt(multi_, CURLMOPT_MAXCONNECTS, static_cast<long>(options_.max_connections));
  curl_multi_setopt(multi_, CURLMOPT_PIPELINING, options_.http_version == "2" ? CURLPIPE_MULTIPLEX : CURLPIPE_NOTHING);
  return Status::Ok();
}

// ---- curl callbacks: record what curl wants; never call back into curl ----

int HttpClient::Impl::OnSocket(CURL*, curl_socket_t fd, int what, void* userp, void* socketp) {
  auto* self = static_cast<Impl*>(userp);
  auto* s = static_cast<SocketState*>(socketp);
  if (what == CURL_POLL_REMOVE) {
    if (s == nullptr) return 0;
    curl_multi_assign(self->multi_, fd, nullptr);
    s->removed = true;
    if (s->armed) {
      self->loop_.Cancel(s);  // frees itself when the cancellation completes
    } else if (!s->dispatching) {
      delete s;
    }
    return 0;
  }
  if (s == nullptr) {
    s = new SocketState;
    s->impl = self;
    s->fd = fd;
    s->complete = &Impl::OnPollDone;
    s->discard = [](IoOp* op) { delete static_cast<SocketState*>(op); };
    curl_multi_assign(self->multi_, fd, s);
  }
  s->wanted = ((what & CURL_POLL_IN) ? POLLIN : 0u) | ((what & CURL_POLL_OUT) ? POLLOUT : 0u);
  if (s->armed && s->armed_mask != s->wanted) {
    self->loop_.Cancel(s);  // re-armed with the new mask when it completes
  } else if (!s->armed && !s->dispatching) {
    self->Arm(s);
  }
  return 0;
}

int HttpClient::Impl::OnTimer(CURLM*, long timeout_ms, void* userp) {
  auto* self = static_cast<Impl*>(userp);
  if (self->timer_ != nullptr) {
    // Stale now: it frees itself on completion and must not touch us then
    // (we may be gone).
    self->timer_->impl = nullptr;
    self->loop_.Cancel(self->timer_);
    self->timer_ = nullptr;
  }
  if (timeout_ms < 0) return 0;
  auto* t = new TimerOp;
  t->impl = self;
  t->complete = &Impl::OnTimerDone;
  t->discard = [](IoOp* op) { delete static_cast<TimerOp*>(op); };
  t->ts.tv_sec = timeout_ms / 1000;
  t->ts.tv_nsec = (timeout_ms % 1000) * 1'000'000;
  io_uring_sqe* sqe = self->loop_.GetSqe();
  io_uring_prep_timeout(sqe, &t->ts, 0, 0);
  self->loop_.Arm(sqe, t);
  self->timer_ = t;
  return 0;
}

// ---- io_uring completions: the only places curl is driven from ----

void HttpClient::Impl::Arm(SocketState* s) {
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_poll_add(sqe, s->fd, s->wanted);
  loop_.Arm(sqe, s);
  s->armed = true;
  s->armed_mask = s->wanted;
}

void HttpClient::Impl::OnPollDone(IoOp* op, int res, uint32_t) {
  auto* s = static_cast<SocketState*>(op);
  s->armed = false;
  if (s->removed) {
    delete s;
    return;
  }
  Impl* self = s->impl;
  if (res != -ECANCELED) {
    int ev = 0;
    if (res < 0) {
      ev = CURL_CSELECT_ERR;
    } else {
      if (res & (POLLIN | POLLHUP)) ev |= CURL_CSELECT_IN;
      if (res & POLLOUT) ev |= CURL_CSELECT_OUT;
      if (res & POLLERR) ev |= CURL_CSELECT_ERR;
    }
    s->dispatching = true;
    self->Act(s->fd, ev);
    s->dispatching = false;
    if (s->removed) {
      delete s;
      return;
    }
  }
  if (!s->armed && s->wanted != 0) self->Arm(s);
}

void HttpClient::Impl::OnTimerDone(IoOp* op, int res, uint32_t) {
  auto* t = static_cast<TimerOp*>(op);
  Impl* self = t->impl;  // null once superseded or orphaned
  if (self != nullptr) self->timer_ = nullptr;
  delete t;
  if (self != nullptr && res == -ETIME) self->Act(CURL_SOCKET_TIMEOUT, 0);
}

void HttpClient::Impl::Act(curl_socket_t fd, int ev_bitmask) {
  int running = 0;
  curl_multi_socket_action(multi_, fd, ev_bitmask, &running);
  DrainMessages();
}

void HttpClient::Impl::DrainMessages() {
  int left = 0;
  while (CURLMsg* msg = curl_multi_info_read(multi_, &left)) {
    if (msg->msg != CURLMSG_DONE) continue;
    Transfer* t = nullptr;
    curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, reinterpret_cast<char**>(&t));
    t->result = msg->data.result;
    curl_multi_remove_handle(multi_, msg->easy_handle);
    loop_.Schedule(t->waiter);  // not inline: we are still inside curl's bookkeeping
  }
}

// ---- body and header callbacks ----

size_t HttpClient::Impl::OnRead(char* buf, size_t size, size_t n, void* userp) {
  auto* t = static_cast<Transfer*>(userp);
  const Request& r = *t->request;
  size_t cap = size * n;
  size_t copied = 0;
  if (!r.body.empty()) {
    size_t take = std::min<uint64_t>(cap, r.body.size() - t->read_pos);
    std::memcpy(buf, r.body.data() + t->read_pos, take);
    t->read_pos += take;
    return take;
  }
  // Walk the pieces to the read position (few pieces: a linear walk is fine).
  uint64_t base = 0;
  for (const BodyPiece& p : r.pieces) {
    if (copied == cap) break;
    uint64_t pos = t->read_pos + copied;
    if (pos < base + p.len) {
      size_t off = static_cast<size_t>(pos - base);
      size_t take = std::min(cap - copied, p.len - off);
      std::memcpy(buf + copied, p.data + off, take);
      copied += take;
    }
    base += p.len;
  }
  t->read_pos += copied;
  return copied;
}

// curl rewinds a request body only to send it again on its own, e.g. when a
// reused connection dies mid-request. That would hide the failure from the
// caller, who knows better: a resumable upload asks the server what it kept
// and resends only the rest. So refuse, and let the request fail
// (CURLE_SEND_FAIL_REWIND, reported as Unavailable).
int HttpClient::Impl::OnSeek(void* userp, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(userp);
  if (origin == SEEK_SET && offset == 0 && t->read_pos == 0) return CURL_SEEKFUNC_OK;  // nothing sent yet
  return CURL_SEEKFUNC_CANTSEEK;
}

size_t HttpClient::Impl::OnWrite(char* data, size_t size, size_t n, void* userp) {
  auto* t = static_cast<Transfer*>(userp);
  size_t len = size * n;
  long status = 0;
  curl_easy_getinfo(t->easy.get(), CURLINFO_RESPONSE_CODE, &status);
  // Error bodies (JSON with the server's message) always go to body.
  if (t->request->response_buffer != nullptr && status >= 200 && status < 300) {
    if (t->response.body_bytes + len > t->request->response_capacity) {
      t->overflow = true;
      return 0;  // aborts the transfer with CURLE_WRITE_ERROR
    }
    if (t->request->on_body) t->request->on_body(data, len);
    std::memcpy(t->request->response_buffer + t->response.body_bytes, data, len);
  } else {
    if (t->response.body_bytes + len > t->request->max_body) {
      t->overflow = true;
      return 0;
    }
    t->response.body.append(data, len);
  }
  t->response.body_bytes += len;
  return len;
}

size_t HttpClient::Impl::OnHeader(char* data, size_t size, size_t n, void* userp) {
  auto* t = static_cast<Transfer*>(userp);
  std::string_view line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {
    t->response.headers.clear();  // a new response (after 100 Continue or a redirect)
    return size * n;
  }
  size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    t->response.headers.emplace_back(Lower(Trim(line.substr(0, colon))), std::string(Trim(line.substr(colon + 1))));
  }
  return size * n;
}

// curl's own low-speed check averages over a window of several seconds, so a
// burst (a chunk swallowed by the socket buffer) hides a stall behind it. We
// time the last byte moved ourselves; curl calls this at least once a second
// while the low-speed options are set.
int HttpClient::Impl::OnProgress(void* userp, curl_off_t, curl_off_t dlnow, curl_off_t, curl_off_t ulnow) {
  auto* t = static_cast<Transfer*>(userp);
  auto now = std::chrono::steady_clock::now();
  if (dlnow != t->last_down || ulnow != t->last_up) {
    t->last_down = dlnow;
    t->last_up = ulnow;
    t->last_progress = now;
    return 0;
  }
  if (now - t->last_progress >= t->stall_timeout) {
    t->stalled = true;
    return 1;  // abort: CURLE_ABORTED_BY_CALLBACK
  }
  return 0;
}

// ---- requests ----

Status HttpClient::Impl::Configure(Transfer* t) {
  Request& r = *t->request;
  t->easy.reset(curl_easy_init());
  CURL* e = t->easy.get();
  if (e == nullptr) return InternalError("curl_easy_init failed");
  for (const BodyPiece& p : r.pieces) t->body_size += p.len;
  if (!r.body.empty()) t->body_size = r.body.size();
  curl_slist* list = nullptr;
  for (const std::string& h : r.headers) list = curl_slist_append(list, h.c_str());
  list = curl_slist_append(list, "Expect:");  // no 100-continue round trip
  t->headers.reset(list);
  curl_easy_setopt(e, CURLOPT_URL, r.url.c_str());
  curl_easy_setopt(e, CURLOPT_PRIVATE, t);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->error);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
  long stall_s = std::max<long>(1, static_cast<long>((options_.stall_timeout.count() + 999) / 1000));
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, stall_s);
  t->stall_timeout = options_.stall_timeout;
  if (r.time_limit.count() > 0) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(r.time_limit.count()));
  if (r.max_send_speed > 0) {
    curl_easy_setopt(e, CURLOPT_MAX_SEND_SPEED_LARGE, static_cast<curl_off_t>(r.max_send_speed));
  }
  t->last_progress = std::chrono::steady_clock::now();
  curl_easy_setopt(e, CURLOPT_XFERINFOFUNCTION, &Impl::OnProgress);
  curl_easy_setopt(e, CURLOPT_XFERINFODATA, t);
  curl_easy_setopt(e, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(e, CURLOPT_HTTP_VERSION,
                   options_.http_version == "2"
                       ? (r.url.rfind("https:", 0) == 0 ? CURL_HTTP_VERSION_2TLS : CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE)
                       : CURL_HTTP_VERSION_1_1);
  if (!options_.ca_file.empty()) {
    curl_easy_setopt(e, CURLOPT_CAINFO, options_.ca_file.c_str());
  } else if (const std::string& system = SystemCaBundle(); !system.empty()) {
    curl_easy_setopt(e, CURLOPT_CAINFO, system.c_str());  // a libcurl without a default of its own
  }
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &Impl::OnWrite);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
  curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &Impl::OnHeader);
  curl_easy_setopt(e, CURLOPT_HEADERDATA, t);
  curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(e, CURLOPT_UPLOAD_BUFFERSIZE, 1024L * 1024);
  const bool has_body = r.method == "PUT" || r.method == "POST" || t->body_size > 0;
  if (has_body) {
    curl_easy_setopt(e, CURLOPT_READFUNCTION, &Impl::OnRead);
    curl_easy_setopt(e, CURLOPT_READDATA, t);
    curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, &Impl::OnSeek);
    curl_easy_setopt(e, CURLOPT_SEEKDATA, t);
    if (r.method == "POST") {
      curl_easy_setopt(e, CURLOPT_POST, 1L);
      curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(t->body_size));
    } else {
      curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(t->body_size));
      if (r.method != "PUT") curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, r.method.c_str());
    }
  } else if (r.method == "HEAD") {
    curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
  } else if (r.method != "GET") {
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, r.method.c_str());
  }
  return Status::Ok();
}

Task<Result<Response>> HttpClient::Impl::Send(Request request) {
  Transfer t;
  t.request = &request;
  const std::string what = request.method + " " + request.url.substr(0, request.url.find('?'));
  CO_TRY(Configure(&t));
  ++stats.requests;
  TransferAwaiter awaiter(this, &t);
  const auto started = std::chrono::steady_clock::now();
  co_await awaiter;
  t.response.bytes_sent = t.read_pos;
  stats.bytes_sent += t.read_pos;
  stats.bytes_received += t.response.body_bytes;
  if (t.result != CURLE_OK) {
    ++stats.transport_errors;
    if (t.overflow) {
      const size_t limit = request.response_buffer != nullptr ? request.response_capacity : request.max_body;
      co_return CorruptionError(what + ": the response body is longer than the " + std::to_string(limit) +
                                " bytes expected");
    }
    if (t.stalled) {
      co_return DeadlineExceededError(what + ": stalled: no byte moved for " +
                                      std::to_string(options_.stall_timeout.count()) + " ms");
    }
    // (Not a connect timeout: that one fires before the time limit.)
    if (t.result == CURLE_OPERATION_TIMEDOUT && request.time_limit.count() > 0 &&
        std::chrono::steady_clock::now() - started >= request.time_limit) {
      co_return DeadlineExceededError(what + ": not done within its time limit of " +
                                      std::to_string(request.time_limit.count()) + " ms (" + t.error + ")");
    }
    co_return CurlCodeToStatus(t.result, what, t.error);
  }
  curl_easy_getinfo(t.easy.get(), CURLINFO_RESPONSE_CODE, &t.response.status);
  co_return std::move(t.response);
}

// ---------------------------------------------------------------------------

Result<std::unique_ptr<HttpClient>> HttpClient::Create(Loop& loop, HttpOptions options) {
  auto impl = std::make_unique<Impl>(loop, std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<HttpClient>(new HttpClient(std::move(impl)));
}

HttpClient::HttpClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpClient::~HttpClient() = default;

Task<Result<Response>> HttpClient::Send(Request request) { return impl_->Send(std::move(request)); }

const HttpStats& HttpClient::stats() const { return impl_->stats; }

}  // namespace ckptio::http
