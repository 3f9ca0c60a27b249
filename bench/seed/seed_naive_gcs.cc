// The naive mode on gs:// (see seed_naive.h): each thread makes its own
// io_uring loop, HTTP client and GCS client, uploads the whole state as one
// object, the tensors back to back, straight from the trainer's live buffers
// (no CRC32C sent: the bytes change under the upload), then lists the
// checkpoints and deletes all but the newest `keep`, object by object.
//
// One object per save, like flax's one msgpack file, rather than the local
// mode's file per tensor: the emulator is one Python process that managed
// about 10 requests/s here, and 100 objects per save (two requests each,
// from 20 overlapping threads) took it over 10 minutes for 20 saves of
// 128 MiB, measuring the emulator instead of the naive saver.

#include <algorithm>
#include <map>
#include <memory>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "seed/seed_naive.h"
#include "format/crc32c.h"
#include "base/dtype.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "gcs/gcs_url.h"
#include "http/http_client.h"
#include "runtime/loop.h"

namespace ckptio::cli::naive {
namespace {

constexpr char kStateObjectName[] = "state.bin";

// A loop with a GCS client on the calling thread. Members are destroyed in
// reverse order: the client before its auth, HTTP client and loop.
struct Session {
  const Target* target = nullptr;
  std::unique_ptr<runtime::Loop> loop;
  std::unique_ptr<http::HttpClient> http;
  std::unique_ptr<gcs::AuthProvider> auth;
  std::unique_ptr<gcs::GcsClient> client;
};

Result<std::unique_ptr<Session>> OpenSession(const Target& target) {
  auto s = std::make_unique<Session>();
  s->target = &target;
  ASSIGN_OR_RETURN(s->loop, runtime::Loop::Create());
  http::HttpOptions ho;  // as storage::OpenGcsStorage makes it
  ho.max_connections = target.options.connections;
  ho.http_version = target.options.http_version;
  ho.connect_timeout = target.options.timeouts.connect;
  ho.stall_timeout = target.options.timeouts.stall;
  ho.ca_file = target.options.ca_file;
  ASSIGN_OR_RETURN(s->http, http::HttpClient::Create(*s->loop, ho));
  ASSIGN_OR_RETURN(s->auth, gcs::MakeAuth(*s->loop, *s->http, target.options, target.emulator));
  s->client = std::make_unique<gcs::GcsClient>(*s->loop, *s->http, *s->auth, target.endpoint, target.options);
  return s;
}

std::string StepPrefix(const Target& t, int64_t step) {
  return (t.prefix.empty() ? "" : t.prefix + "/") + StepDirName(step) + "/";
}

std::string RootPrefix(const Target& t) { return t.prefix.empty() ? "" : t.prefix + "/"; }

// DELETE of one object, returning the HTTP status: the naive pruner wants
// to know about a 404 (GcsClient::Delete counts it as deleted).
Task<Result<long>> DeleteObject(Session* s, std::string name) {
  http::Request r;
  r.method = "DELETE";
  r.url = s->target->endpoint + "/storage/v1/b/" + gcs::UrlEncode(s->target->bucket) + "/o/" + gcs::UrlEncode(name);
  CO_ASSIGN_OR_RETURN(std::string header, co_await s->auth->Header());
  if (!header.empty()) r.headers.push_back(header);
  CO_ASSIGN_OR_RETURN(http::Response response, co_await s->http->Send(std::move(r)));
  co_return response.status;
}

// Deletes every object of one checkpoint, all at once.
Task<Shared::PruneOutcome> RemoveGcsCheckpoint(Session* s, int64_t step, std::string* what) {
  const std::string prefix = StepPrefix(*s->target, step);
  Task<Result<gcs::ListResult>> list = s->client->List(s->target->bucket, prefix, "");
  Result<gcs::ListResult> listing = co_await std::move(list);
  if (!listing.ok()) {
    *what = listing.status().message();
    co_return Shared::PruneOutcome::kOther;
  }
  if (listing->objects.empty()) {
    *what = "gs://" + s->target->bucket + "/" + prefix + " has no objects left";
    co_return Shared::PruneOutcome::kAlreadyGone;
  }
  std::vector<Task<Result<long>>> deletes;
  for (const gcs::ObjectMeta& o : listing->objects) deletes.push_back(DeleteObject(s, o.name));
  Task<std::vector<Result<long>>> all = WhenAll(std::move(deletes));
  std::vector<Result<long>> done = co_await std::move(all);
  Shared::PruneOutcome outcome = Shared::PruneOutcome::kOk;
  for (size_t i = 0; i < done.size(); ++i) {
    const std::string name = "delete gs://" + s->target->bucket + "/" + listing->objects[i].name;
    if (!done[i].ok()) {
      *what = done[i].status().message();
      co_return Shared::PruneOutcome::kOther;
    }
    if (*done[i] == 404) {
      *what = name + ": 404, already deleted";
      outcome = Shared::PruneOutcome::kAlreadyGone;
    } else if (*done[i] >= 300) {
      *what = name + ": HTTP " + std::to_string(*done[i]);
      co_return Shared::PruneOutcome::kOther;
    }
  }
  co_return outcome;
}

Task<void> PruneGcs(Session* s, Shared* shared, ThreadRecord* record) {
  Task<Result<gcs::ListResult>> list = s->client->List(s->target->bucket, RootPrefix(*s->target), "/");
  Result<gcs::ListResult> listing = co_await std::move(list);
  if (!listing.ok()) {
    shared->CountPrune(Shared::PruneOutcome::kOther, false, listing.status().message());
    co_return;
  }
  std::vector<int64_t> steps;
  for (const std::string& p : listing->prefixes) {
    if (int64_t step = ParseStepDirName(p.substr(RootPrefix(*s->target).size())); step >= 0) steps.push_back(step);
  }
  std::sort(steps.rbegin(), steps.rend());
  const size_t keep = static_cast<size_t>(std::max(shared->config().keep, 0));
  for (size_t i = keep; keep > 0 && i < steps.size(); ++i) {
    const bool in_flight = shared->Writing(steps[i]);
    std::string what;
    const Shared::PruneOutcome o = co_await RemoveGcsCheckpoint(s, steps[i], &what);
    shared->CountPrune(o, in_flight, what);
    if (o == Shared::PruneOutcome::kOk) ++record->pruned;
  }
}

uint64_t TensorSize(const TensorRef& t) { return base::TensorBytes(t.dtype, t.shape).value(); }

Task<void> SaveAndPrune(Session* s, Shared* shared, ThreadRecord* record) {
  gcs::UploadSource source;
  for (const TensorRef& t : shared->tensors()) {
    const uint64_t n = TensorSize(t);
    source.pieces.push_back({static_cast<const char*>(t.data), static_cast<size_t>(n)});
    source.size += n;
  }
  const std::string name = StepPrefix(*s->target, record->step) + kStateObjectName;
  // The task first: no temporaries in the co_await's full expression (g++ 12).
  Task<Result<gcs::ObjectMeta>> upload = s->client->Upload(s->target->bucket, name, &source);
  Result<gcs::ObjectMeta> done = co_await std::move(upload);
  if (done.ok()) {
    record->bytes_written += source.size;
  } else {
    ++record->write_errors;
    shared->CountWriteError(done.status().message());
  }
  record->write_end = Clock::now();
  shared->EndWriting(record->step);
  co_await PruneGcs(s, shared, record);
}

Task<Result<gcs::ListResult>> ListAll(Session* s) {
  Task<Result<gcs::ListResult>> list = s->client->List(s->target->bucket, RootPrefix(*s->target), "");
  co_return co_await std::move(list);
}

// Reads one naive object back and counts the tensors whose bytes differ
// from the state at save time.
Task<Result<int>> CountTornTensors(Session* s, std::string name, uint64_t size, std::vector<TensorRef> tensors,
                                   std::vector<uint32_t> expected) {
  std::vector<char> bytes(size);
  Task<Status> read = s->client->Read(s->target->bucket, name, 0, size, bytes.data(), size);
  CO_TRY(co_await std::move(read));
  int torn = 0;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = TensorSize(tensors[i]);
    if (format::Crc32c(bytes.data() + offset, n) != expected[i]) ++torn;
    offset += n;
  }
  co_return torn;
}

// Audits one step: its object's size from the listing, its CRC32C (the
// server's) against the state's; a mismatch is read back to count the torn
// tensors.
StepAudit AuditStep(const SeedConfig& config, int64_t step, const std::map<std::string, gcs::ObjectMeta>& objects,
                    Session* s, std::span<const TensorRef> tensors, const ExpectedCrcs& expected) {
  StepAudit a;
  a.step = step;
  a.expected = ExpectedKept(config, step);
  const std::string prefix = StepPrefix(*s->target, step);
  auto first = objects.lower_bound(prefix);
  a.present = first != objects.end() && first->first.compare(0, prefix.size(), prefix) == 0;
  if (!a.present) return a;
  uint64_t total = 0;
  for (const TensorRef& t : tensors) total += TensorSize(t);
  auto o = objects.find(prefix + kStateObjectName);
  a.complete = o != objects.end() && o->second.size == total;
  a.tensors_present = a.complete ? static_cast<int>(tensors.size()) : 0;
  auto it = expected.find(step);
  if (!a.complete || it == expected.end()) return a;
  a.checked = true;
  uint32_t want = 0;
  for (size_t i = 0; i < tensors.size(); ++i) want = format::Crc32cCombine(want, it->second[i], TensorSize(tensors[i]));
  if (o->second.crc32c && *o->second.crc32c == want) return a;
  Result<int> torn = s->loop->Run(CountTornTensors(s, o->first, total, {tensors.begin(), tensors.end()}, it->second));
  // Unreadable: count it torn as a whole rather than pass it.
  a.tensors_torn = torn.ok() ? std::max(*torn, 1) : static_cast<int>(tensors.size());
  return a;
}

Task<Status> DeleteAll(Session* s) {
  CO_ASSIGN_OR_RETURN(gcs::ListResult listing, co_await ListAll(s));
  std::vector<Task<Status>> deletes;
  for (const gcs::ObjectMeta& o : listing.objects) deletes.push_back(s->client->Delete(s->target->bucket, o.name));
  Task<std::vector<Status>> all = WhenAll(std::move(deletes));
  std::vector<Status> done = co_await std::move(all);
  for (Status& st : done) CO_TRY(st);
  co_return Status::Ok();
}

}  // namespace

void RunGcsThread(Shared* shared, ThreadRecord* record) {
  auto session = OpenSession(shared->target());
  if (!session.ok()) {
    shared->CountWriteError(session.status().message());
    record->write_errors = static_cast<int>(shared->tensors().size());
    record->write_end = record->end = Clock::now();
    shared->EndWriting(record->step);
    return;
  }
  Session* s = session->get();
  s->loop->Run(SaveAndPrune(s, shared, record));
  record->end = Clock::now();
}

AuditResult AuditGcs(const SeedConfig& config, const Target& target, std::span<const TensorRef> tensors,
                     const ExpectedCrcs& expected) {
  AuditResult audit;
  audit.tensors = static_cast<int>(tensors.size());
  auto session = OpenSession(target);
  if (!session.ok()) {
    audit.error = session.status().message();
    return audit;
  }
  Result<gcs::ListResult> listing = (*session)->loop->Run(ListAll(session->get()));
  if (!listing.ok()) {
    audit.error = listing.status().message();
    return audit;
  }
  std::map<std::string, gcs::ObjectMeta> objects;
  for (gcs::ObjectMeta& o : listing->objects) objects.emplace(o.name, std::move(o));
  for (int i = 1; i <= config.saves; ++i) {
    audit.steps.push_back(AuditStep(config, SeedStep(i), objects, session->get(), tensors, expected));
  }
  return audit;
}

Status CleanupGcs(const Target& target) {
  ASSIGN_OR_RETURN(auto session, OpenSession(target));
  return session->loop->Run(DeleteAll(session.get()));
}

}  // namespace ckptio::cli::naive
