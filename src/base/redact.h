#pragma once
// Recognising credentials in text, so that none reaches an error message, a
// log line, a trace or a config dump.
//
// Two uses: a value we print on purpose (a configured header, in
// `ckptio config show`) is hidden whole when it looks like a credential;
// text a server wrote (an error body that echoes the request, with our
// Authorization header in it) keeps its words, with the credentials in it
// replaced by "<redacted>".
//
// Pure functions; any thread.

#include <span>
#include <string>
#include <string_view>

namespace ckptio::base {

inline constexpr std::string_view kRedacted = "<redacted>";

// True iff `value` looks like a credential: an Authorization value with a
// scheme and its credentials ("Bearer ...", "Basic ...", ...), an OAuth2
// access token ("ya29."), a refresh token ("1//"), a JWT, a Google API key
// ("AIza"), a "user:password@" URL, or one long token-like word (24 or more
// characters of letters, digits and -._~+/= with both letters and digits).
bool LooksLikeCredential(std::string_view value);

// `text` with every occurrence of each of `known` (empty ones skipped), the
// word after "Bearer " or "Basic " (any case, 8 or more characters) and every
// word that starts with "ya29." replaced by "<redacted>".
std::string RedactCredentials(std::string_view text, std::span<const std::string> known = {});

}  // namespace ckptio::base
