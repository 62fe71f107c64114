// Memory for the drafter's large random-access arrays (chain tables, chain pools, stored
// tokens), backed by transparent huge pages (2 MB).
//
// Why: these arrays are hundreds of MB in all, read and written one cache line at a time at
// random (a table slot here, a chain block there, another sequence's continuation). With 4 KB
// pages nearly every such access also misses the TLB, and a page walk (two-dimensional under a
// hypervisor) costs about as much as the cache miss and overlaps poorly. Most of these arrays
// are small (a request's own index, one sequence's tokens), so they cannot get huge pages of
// their own: arrays up to 1 MB are carved from shared 2 MB chunks (power-of-two size classes,
// freed blocks reused per class), larger ones get whole huge pages. Once faulting in a chunk's
// huge page has been seen to be costly (a VM whose host takes free memory back), later chunks
// are advised to be huge only when used up, so that khugepaged collapses them in the background
// (see huge_pages.cpp). Chunks are never given back to the system;
// freed blocks serve later arrays of their class (eviction frees and rebuilds reuse them).
// Without THP (or with it disabled) this is plain memory.
#pragma once

#include <cstddef>

namespace rollout_spec {

void* huge_alloc(size_t bytes);
void huge_free(void* p, size_t bytes) noexcept;
// Install the arena's fork handlers now unless its first use did (they take its lock around a
// fork); handlers installed after them run their prepare step first (see fork_guard.h).
void install_arena_fork_handlers();

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() noexcept = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) { return static_cast<T*>(huge_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { huge_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept { return false; }
};

}  // namespace rollout_spec
