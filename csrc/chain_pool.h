// Storage for the older records of hash chains (all but the newest, which sits in the head).
//
// A search reads at most the newest `keep` records of a chain, so only those are kept: a chain's
// older records live in one contiguous block whose capacity grows with the chain (size classes
// of 1, 3, 7, 15, ... entries) up to the largest class, which is then used as a ring. A walk is
// therefore one block read front to back (its lines can all be prefetched at once) instead of
// a list of blocks followed pointer by pointer. All blocks share one array (an index's
// bookkeeping is a few cache lines, since a request's own index is cold at every call); blocks
// outgrown are reused through free lists.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include "chain_table.h"
#include "huge_pages.h"

namespace rollout_spec {

class ChainPool {
 public:
  // Keep up to `max_older` older records per chain (rounded up to a class capacity, 2^m - 1).
  explicit ChainPool(int32_t max_older)
      : max_older_(max_older > 0 ? capacity(class_for(max_older)) : 0) {
    std::fill(std::begin(free_), std::end(free_), -1);
  }

  // Most older records a chain keeps.
  int32_t max_older() const { return max_older_; }

  // Entries of a block of class c (c = class_for(older records kept)).
  static int32_t capacity(int c) { return (int32_t(2) << c) - 1; }
  // The smallest class holding n >= 1 records: capacity(c) = 2^(c+1) - 1 >= n.
  static int class_for(int32_t n) { return 31 - __builtin_clz(static_cast<uint32_t>(n)); }

  // Record `e` as the older record number `i` (0 = oldest ever) of the chain whose older
  // records are in `block`; grows the block (or starts one) as needed.
  void put(int32_t& block, int32_t i, const ChainEntry& e) {
    const int32_t cmax = max_older();
    if (cmax == 0) return;
    if (i < cmax) {  // growing: entries sit at their own index
      const int c = class_for(i + 1);
      if (i == 0 || class_for(i) != c) block = regrow(block, i, c);
      arena_[size_t(block) + i] = e;
    } else {
      arena_[size_t(block) + i % cmax] = e;
    }
  }

  // The block holding a chain's `older` (>= 1) older records, its capacity as `cap`.
  const ChainEntry* entries(int32_t block, int32_t older, int32_t& cap) const {
    cap = capacity(class_for(std::min(older, max_older())));
    return arena_.data() + block;
  }

  void clear() {
    arena_ = {};
    std::fill(std::begin(free_), std::end(free_), -1);
  }

  size_t memory_bytes() const { return arena_.capacity() * sizeof(ChainEntry); }

 private:
  static constexpr int kMaxClasses = 13;  // capacities up to 8191 entries

  // A block of class c holding the first `n` entries of `old` (a block of the class below,
  // which goes to its free list). A free block keeps the next free one's offset in its first
  // entry's `seq`, so the free lists cost no memory of their own.
  int32_t regrow(int32_t old, int32_t n, int c) {
    int32_t b = free_[c];
    if (b >= 0) {
      free_[c] = arena_[b].seq;
    } else {
      b = static_cast<int32_t>(arena_.size());
      const size_t need = arena_.size() + capacity(c);
      // Grow in powers of two: the allocator's size classes are powers of two, so any other
      // capacity would leave part of its block unused. (need > 64 keeps clz's argument nonzero.)
      if (need > arena_.capacity()) {
        arena_.reserve(need <= 64 ? size_t(64) : size_t(1) << (64 - __builtin_clzll(need - 1)));
      }
      arena_.resize(need);
    }
    if (n > 0) {
      std::copy(arena_.begin() + old, arena_.begin() + old + n, arena_.begin() + b);
      arena_[old].seq = free_[c - 1];
      free_[c - 1] = old;
    }
    return b;
  }

  // Capacity of the largest class in use (0: no older records kept). Stored rather than derived
  // from the class count: every insert and every walk reads it.
  int32_t max_older_ = 0;
  int32_t free_[kMaxClasses];       // per class: offset of the first free block, -1 if none
  std::vector<ChainEntry, HugePageAllocator<ChainEntry>> arena_;  // every block, addressed by the offset of its first entry
};

}  // namespace rollout_spec
