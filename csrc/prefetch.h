// Start loading the cache line at `p` into every cache level; never faults.
//
// Why not __builtin_prefetch: GCC 12 at -O2/-O3 deletes a __builtin_prefetch that is the only
// work under an `if` (a prefetch has no visible effect, so the branch looks empty), which
// silently removed most of this project's prefetches. An asm volatile statement is never removed.
#pragma once

namespace rollout_spec {

inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

}  // namespace rollout_spec
