#pragma once
// CKPTIO_EXPORT marks the C++ API that libckptio exports. The library is
// built with -fvisibility=hidden: every symbol without it stays inside, so
// the layers linked into it (and their copies of nlohmann_json, ...) cannot
// clash with another copy in the same process. tests/install checks the
// list of exported symbols.

#if defined(__GNUC__)
#define CKPTIO_EXPORT [[gnu::visibility("default")]]
#else
#define CKPTIO_EXPORT
#endif
