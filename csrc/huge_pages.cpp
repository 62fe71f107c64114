#include "huge_pages.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>

#include <pthread.h>
#include <sys/mman.h>

namespace rollout_spec {

namespace {
constexpr size_t kChunk = size_t(1) << 21;  // 2 MB: the huge page size of x86-64 and arm64
constexpr int kMinShift = 6;                // smallest block: one cache line
constexpr int kMaxShift = 20;               // largest block carved from a chunk: 1 MB

// Advise that [p, p + bytes) be backed by huge pages (advice only: never fails for it).
void advise_huge(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
}

// 2 MB-aligned memory, advised to be backed by huge pages from its first touch if `advised`.
void* huge_pages(size_t bytes, bool advised) {
  void* p = nullptr;
  if (posix_memalign(&p, kChunk, bytes) != 0) throw std::bad_alloc();
  if (advised) advise_huge(p, bytes);
  return p;
}

// Size class of a block: blocks of class c hold 2^c bytes.
int class_of(size_t bytes) {
  int c = kMinShift;
  while ((size_t(1) << c) < bytes) ++c;
  return c;
}

// Whether faulting in a huge page at first touch was cheap: `chunk` (fresh, 2 MB) is advised and
// its first byte written, which faults the whole huge page in, and timed. Bare metal zeroes 2 MB
// in ~0.1-0.3 ms; a VM whose host has taken the free 2 MB block back (free page reporting) must
// back it again first: ~4 ms on the 2-CPU VM (where 2 MB in 4 KB pages cost ~0.8 ms), unless
// the block was freed moments ago.
bool huge_first_touch_is_cheap(char* chunk) {
  advise_huge(chunk, kChunk);
  const auto start = std::chrono::steady_clock::now();
  *static_cast<volatile char*>(chunk) = 0;
  return std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1);
}

struct Arena {
  std::mutex mu;                       // drafters of several threads share the arena
  void* free[kMaxShift + 1] = {};      // per class: freed blocks, linked through their first word
  // Chunks and large arrays are advised as they come, until a huge page was costly to fault in.
  std::atomic<bool> advise_early{true};
  char* chunk = nullptr;               // the newest chunk
  char* cur = nullptr;                 // unused rest of the newest chunk
  size_t left = 0;                     // its bytes
};

// Never destroyed: arrays may be freed during static destruction, after a local static would be.
// A fork while another thread holds the lock would leave the child's copy locked forever, so
// the lock is taken around fork (as glibc does for malloc's own locks).
Arena& arena() {
  static Arena* a = [] {
    Arena* made = new Arena;
    pthread_atfork([] { arena().mu.lock(); }, [] { arena().mu.unlock(); },
                   [] { arena().mu.unlock(); });
    return made;
  }();
  return *a;
}
}  // namespace

void* huge_alloc(size_t bytes) {
  if (bytes > (size_t(1) << kMaxShift)) {
    const size_t size = (bytes + kChunk - 1) & ~(kChunk - 1);
    if (arena().advise_early.load(std::memory_order_relaxed)) return huge_pages(size, true);
    // Its caller fills it at once (a table) or soon (a pool): its pages are faulted in here, 4 KB
    // at a time, and only then is it advised, for khugepaged to collapse later.
    char* p = static_cast<char*>(huge_pages(size, false));
    for (size_t off = 0; off < size; off += 4096) p[off] = 0;
    advise_huge(p, size);
    return p;
  }
  const int c = class_of(bytes);
  const size_t size = size_t(1) << c;
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  if (void* p = a.free[c]) {
    a.free[c] = *static_cast<void**>(p);
    return p;
  }
  if (a.left < size) {
    // The chunk's rest is too small for this block: hand it out as smaller blocks later.
    while (a.left >= (size_t(1) << kMinShift)) {
      int r = kMinShift;
      while ((size_t(2) << r) <= a.left) ++r;
      *reinterpret_cast<void**>(a.cur) = a.free[r];
      a.free[r] = a.cur;
      a.cur += size_t(1) << r;
      a.left -= size_t(1) << r;
    }
    // Once a huge page was costly to fault in, a chunk is advised only when used up, its
    // blocks mostly touched (in 4 KB pages): khugepaged then collapses it into a huge page in
    // the background. On the 2-CPU VM that made the bench's first T=0.6 replay 15% cheaper at
    // steps 1-2, while a replay on warm memory (huge pages) was 2% cheaper; on the Xeon host,
    // where the fault is cheap, deferring cost 3-5%.
    char* fresh = static_cast<char*>(huge_pages(kChunk, false));
    if (a.advise_early.load(std::memory_order_relaxed)) {
      a.advise_early.store(huge_first_touch_is_cheap(fresh), std::memory_order_relaxed);
    } else {
      advise_huge(a.chunk, kChunk);
    }
    a.chunk = a.cur = fresh;
    a.left = kChunk;
  }
  void* p = a.cur;
  a.cur += size;
  a.left -= size;
  return p;
}

void install_arena_fork_handlers() { (void)arena(); }

void huge_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes > (size_t(1) << kMaxShift)) {
    std::free(p);
    return;
  }
  const int c = class_of(bytes);
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  *static_cast<void**>(p) = a.free[c];
  a.free[c] = p;
}

}  // namespace rollout_spec
