#pragma once
// Reading untrusted JSON (safetensors headers, manifests) without trusting it:
// a strict parse, then typed field access whose every error is a Corruption
// that names the file and the object. No nlohmann exception escapes.

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptio/status.h"

namespace ckptio::format {

using Json = nlohmann::json;

// No ckptio document nests more than 3 levels (user metadata aside); each
// level costs the parser memory, so a hostile "[[[[..." is cut off early.
inline constexpr int kMaxJsonDepth = 64;

// Parses `bytes` as one JSON value. Errors are Corruption "<file>: <what> ...":
// syntax errors and invalid UTF-8; nesting deeper than kMaxJsonDepth; and a
// key repeated in any object, which nlohmann would merge silently (keeping
// one), so that two readers could disagree about what the file holds.
Result<Json> ParseUntrustedJson(std::string_view file, std::string_view what,
                                std::string_view bytes);

// Typed access to the fields of an untrusted JSON object. `context` names the
// file and the object, e.g. `m.json: tensor "w"`; errors read
// `m.json: tensor "w": field "shape" must be an array of unsigned integers`.
// The reader keeps a reference to obj: it must outlive the reader.
class FieldReader {
 public:
  FieldReader(std::string context, const Json& obj) : context_(std::move(context)), obj_(obj) {}

  const std::string& context() const { return context_; }

  // A Corruption error "<context>: <problem>".
  Status Error(std::string_view problem) const;

  // Every key of the object must be one of `allowed`: an unknown key means a
  // writer we do not understand, and guessing is worse than refusing.
  Status CheckKeys(std::initializer_list<std::string_view> allowed) const;
  Status CheckKeys(std::span<const std::string_view> allowed) const;

  Result<uint64_t> U64(std::string_view key) const;
  Result<int64_t> I64(std::string_view key) const;
  Result<std::string> String(std::string_view key) const;
  Result<std::vector<uint64_t>> U64Array(std::string_view key) const;
  Result<const Json*> Array(std::string_view key) const;
  Result<const Json*> Object(std::string_view key) const;

 private:
  // The field's value, or an error naming it as missing.
  Result<const Json*> Find(std::string_view key) const;
  Status WrongType(std::string_view key, std::string_view expected) const;

  std::string context_;
  const Json& obj_;
};

}  // namespace ckptio::format
