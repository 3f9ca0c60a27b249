/* Linked into the wheel's binaries only (packaging/build-deps.sh, native.ini).
 *
 * The wheel links g++ 12's libstdc++ statically and links against glibc 2.31 (a Debian 11
 * sysroot). That libstdc++.a was built on Debian 12 against glibc 2.36 and refers to two
 * symbols glibc 2.31 lacks; the linker would leave them undefined (the binary would then fail
 * to load on glibc < 2.32) or bind them to the running glibc's copies. Defined here, hidden, so
 * that the copy inside the wheel binds to these and never to glibc's.
 *
 * - __libc_single_threaded (glibc 2.32): libstdc++ reads it to skip atomic operations (shared_ptr
 *   counts, locale) while a process has one thread. 0 means "maybe several threads": the atomic
 *   path is always taken, which is always correct (and what libstdc++ does on glibc < 2.32).
 * - arc4random (glibc 2.36): one of std::random_device's sources. Same contract as glibc's: 32
 *   bits from the kernel's CSPRNG (getrandom, glibc 2.25), never failing.
 */
#include <errno.h>
#include <stdint.h>
#include <sys/random.h>

__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

__attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t value;
  for (;;) {
    ssize_t n = getrandom(&value, sizeof value, 0);
    if (n == (ssize_t)sizeof value) return value;
    if (n < 0 && errno != EINTR) __builtin_trap(); /* no getrandom (Linux < 3.17): io_uring needs 5.1 */
  }
}
