#pragma once
// HttpClient: HTTP requests as coroutines, on the io_uring Loop.
//
// One curl multi handle is driven by the Loop: curl's socket callback arms
// io_uring poll operations, its timer callback arms an io_uring timeout, and
// when a transfer finishes the awaiting coroutine is resumed. There is no
// second event thread. Connections are pooled by the multi handle and reused
// across requests; at most `max_connections` are open at once, and requests
// beyond that wait in curl's queue.
//
// Bodies move without an extra copy of their own: a request body is read
// straight from the caller's buffers (CURLOPT_READFUNCTION), a response body
// can be written straight into a caller's buffer (ranged downloads).
//
// Threads: every method, and every await, on the Loop thread. The caller keeps
// request body buffers and the response buffer alive until Send finishes.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptio/status.h"
#include "runtime/task.h"
#include "runtime/loop.h"

namespace ckptio::http {

struct HttpOptions {
  int max_connections = 16;
  std::string http_version = "1.1";  // "1.1" or "2"
  std::chrono::milliseconds connect_timeout{10000};
  // A transfer that moves no bytes for this long fails (DeadlineExceeded).
  std::chrono::milliseconds stall_timeout{60000};
  std::string ca_file;  // empty: the system's CA bundle
};

// A piece of a request body: bytes the caller owns.
struct BodyPiece {
  const char* data = nullptr;
  size_t len = 0;
};

struct Request {
  std::string method = "GET";
  std::string url;
  // "Name: value" lines. Secrets (Authorization) are never logged by ckptio.
  std::vector<std::string> headers;
  // The body: `body` if not empty, else the pieces in order.
  std::string body;
  std::vector<BodyPiece> pieces;
  // If set, the response body is written here (at most capacity bytes; more
  // is an error) instead of into Response::body.
  char* response_buffer = nullptr;
  size_t response_capacity = 0;
  // If set, called with each block of a 2xx body bound for response_buffer
  // as it arrives, before it is copied there: the block is still in cache
  // (e.g. to checksum the body without a second pass over response_buffer).
  std::function<void(const char* data, size_t len)> on_body;
  // Otherwise (and for error bodies) Response::body holds at most this many
  // bytes; more is an error, so a hostile server cannot make it grow unbounded.
  size_t max_body = size_t{64} << 20;
  // The whole request, connection included, ends by then (DeadlineExceeded)
  // even if bytes still trickle; 0 = no limit but the stall timeout.
  std::chrono::milliseconds time_limit{0};
  // The request body goes out at most this fast (bytes/s); 0 = no cap.
  uint64_t max_send_speed = 0;
};

struct Response {
  long status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;         // when no response_buffer was given
  size_t body_bytes = 0;    // bytes of body received (either way)
  uint64_t bytes_sent = 0;  // request body bytes curl read from the caller

  // The first header with this (lower-case) name, or "".
  std::string_view Header(std::string_view lower_name) const;
};

// Counters for benchmarks and tests.
struct HttpStats {
  uint64_t requests = 0;
  uint64_t transport_errors = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

class HttpClient {
 public:
  static Result<std::unique_ptr<HttpClient>> Create(runtime::Loop& loop, HttpOptions options);
  ~HttpClient();  // REQUIRES: no request in flight.
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends the request and returns the response, whatever its status. A
  // transport failure (refused, reset, timeout, TLS) is an error Status:
  // Unavailable (worth a retry), DeadlineExceeded (stalled), or other codes
  // for what a retry cannot fix. Messages name the method and URL.
  Task<Result<Response>> Send(Request request);

  const HttpStats& stats() const;

  class Impl;

 private:
  explicit HttpClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The one place a CURLcode becomes a Status.
Status CurlCodeToStatus(int curl_code, std::string_view what, std::string_view error_buffer);

}  // namespace ckptio::http
