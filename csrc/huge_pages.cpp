#include "huge_pages.h"

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

struct Arena {
  std::mutex mu;                       // drafters of several threads share the arena
  void* free[kMaxShift + 1] = {};      // per class: freed blocks, linked through their first word
  char* chunk = nullptr;               // the newest chunk (not yet advised to be huge)
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
  if (bytes > (size_t(1) << kMaxShift)) return huge_pages((bytes + kChunk - 1) & ~(kChunk - 1), true);
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
    // The chunk just used up is advised only now, when its blocks are mostly touched: khugepaged
    // then collapses it into a huge page in the background. Advised from the start, each chunk
    // was faulted in as a huge page by the array that first touched it, and on a VM that
    // returns free 2 MB blocks to its host that first touch cost ~3 ms against ~0.8 ms in 4 KB
    // pages (the bench's first T=0.6 replay: steps 1-2 15% dearer; a replay on warm memory 2%
    // cheaper, which long runs get back once khugepaged has been by).
    if (a.chunk) advise_huge(a.chunk, kChunk);
    a.chunk = a.cur = static_cast<char*>(huge_pages(kChunk, false));
    a.left = kChunk;
  }
  void* p = a.cur;
  a.cur += size;
  a.left -= size;
  return p;
}

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
