#include "base/redact.h"

#include <algorithm>
#include <cctype>
#include <vector>

namespace ckptio::base {
namespace {

// RFC 7235 token68, the alphabet of bearer tokens, base64 and JWTs.
bool IsToken68(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("-._~+/=").find(c) != std::string_view::npos;
}

bool StartsWithNoCase(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() &&
         std::equal(prefix.begin(), prefix.end(), s.begin(), [](char a, char b) {
           return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
         });
}

size_t Token68End(std::string_view s, size_t from) {
  while (from < s.size() && IsToken68(s[from])) ++from;
  return from;
}

// Authorization schemes whose credentials follow a space.
constexpr std::string_view kSchemes[] = {"bearer ", "basic ", "digest ", "token ", "negotiate ", "ntlm ",
                                         "aws4-hmac-sha256 ", "goog4-hmac-sha256 "};

// A word of at least 24 token68 characters with letters and digits: what
// random tokens, keys and secrets look like, and words rarely do.
bool LooksLikeRandomToken(std::string_view s) {
  if (s.size() < 24 || Token68End(s, 0) != s.size()) return false;
  const auto is_letter = [](char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; };
  const auto is_digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  const bool letter = std::any_of(s.begin(), s.end(), is_letter);
  const bool digit = std::any_of(s.begin(), s.end(), is_digit);
  return letter && digit;
}

bool LooksLikeJwt(std::string_view s) {
  return s.rfind("eyJ", 0) == 0 && Token68End(s, 0) == s.size() && std::count(s.begin(), s.end(), '.') == 2;
}

bool HasUrlUserinfo(std::string_view s) {
  const size_t scheme_end = s.find("://");
  if (scheme_end == std::string_view::npos) return false;
  const size_t host = scheme_end + 3;
  const size_t authority_end = std::min(s.find_first_of("/?#", host), s.size());
  return s.substr(host, authority_end - host).find('@') != std::string_view::npos;
}

// Replaces [from, to) of *text by kRedacted; returns where to go on.
size_t ReplaceRange(std::string* text, size_t from, size_t to) {
  text->replace(from, to - from, kRedacted);
  return from + kRedacted.size();
}

}  // namespace

bool LooksLikeCredential(std::string_view value) {
  while (!value.empty() && std::isspace(static_cast<unsigned char>(value.front()))) value.remove_prefix(1);
  while (!value.empty() && std::isspace(static_cast<unsigned char>(value.back()))) value.remove_suffix(1);
  for (std::string_view scheme : kSchemes) {
    if (StartsWithNoCase(value, scheme) && value.size() > scheme.size()) return true;
  }
  return value.find("ya29.") != std::string_view::npos || value.rfind("1//", 0) == 0 ||
         (value.rfind("AIza", 0) == 0 && value.size() >= 30) || LooksLikeJwt(value) || HasUrlUserinfo(value) ||
         LooksLikeRandomToken(value);
}

std::string RedactCredentials(std::string_view text, std::span<const std::string> known) {
  std::string out(text);
  // Longest first: a secret that contains another is replaced whole.
  std::vector<std::string_view> secrets;
  for (const std::string& k : known) {
    if (!k.empty()) secrets.push_back(k);
  }
  std::sort(secrets.begin(), secrets.end(), [](std::string_view a, std::string_view b) { return a.size() > b.size(); });
  for (std::string_view secret : secrets) {
    for (size_t at = out.find(secret); at != std::string::npos; at = out.find(secret, at)) {
      at = ReplaceRange(&out, at, at + secret.size());
    }
  }
  // "Bearer <credentials>" and "Basic <credentials>", however the server
  // quoted them.
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string_view rest = std::string_view(out).substr(i);
    for (std::string_view scheme : {std::string_view("bearer "), std::string_view("basic ")}) {
      if (!StartsWithNoCase(rest, scheme) || (i > 0 && std::isalnum(static_cast<unsigned char>(out[i - 1])))) continue;
      size_t from = i + scheme.size();
      while (from < out.size() && out[from] == ' ') ++from;
      const size_t to = Token68End(out, from);
      if (to - from >= 8) i = ReplaceRange(&out, from, to) - 1;
      break;
    }
  }
  // Google OAuth2 access tokens wherever they stand.
  for (size_t at = out.find("ya29."); at != std::string::npos; at = out.find("ya29.", at)) {
    at = ReplaceRange(&out, at, Token68End(out, at + 5));
  }
  return out;
}

}  // namespace ckptio::base
