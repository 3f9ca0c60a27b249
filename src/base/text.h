#pragma once
// Text that comes from outside (names in manifests and headers, a user's
// dtype) as it may appear in messages and JSON.

#include <string>
#include <string_view>

namespace ckptio::base {

// Returns s as a JSON string literal for an error message: quoted, control
// characters escaped, invalid UTF-8 replaced, cut after 120 bytes ("...").
// Hostile names must not be able to forge or flood a log line.
std::string Quoted(std::string_view s);

// True iff s is well-formed UTF-8 (no overlongs, surrogates or code points
// past U+10FFFF): JSON text must be, so every name we serialize must be.
bool IsValidUtf8(std::string_view s);

}  // namespace ckptio::base
