// The lookup side of a chain index: an open-addressing table from an n-gram key to its chain's
// head, where the head holds the newest record itself and the location of the older ones.
// A lookup of a key seen once (most long n-grams) therefore costs one cache line.
//
// Every record carries two tokens of its sequence: the one just before its n-gram (`before`) and
// the one just after it (`after`). A search learns from `before` whether the match is exactly the
// key's length, and gets the first continuation token from `after`, without touching the other
// sequence's memory; most records of a short key are decided that way.
#pragma once

#include "huge_pages.h"
#include "prefetch.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rollout_spec {

struct ChainEntry {
  int32_t seq = -1;     // sequence slot
  int32_t pos = -1;     // index of the n-gram's last token there
  int32_t before = -1;  // token at pos - k, or -1 where the n-gram starts its sequence
  int32_t after = -1;   // token at pos + 1
};

struct ChainHead {
  uint64_t key = 0;    // 0 marks an empty slot (hashes are never 0)
  ChainEntry newest;   // the chain's newest record
  int32_t block = -1;  // the older records' block in the index's pool of its size class
  int32_t count = 0;   // records ever added to the chain (older ones beyond the kept few dropped)
};

class ChainTable {
 public:
  // Head of `key`'s chain, or null.
  const ChainHead* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(key, mask);; i = (i + 1) & mask) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == 0) return nullptr;
    }
  }

  // Head of `key`'s chain, inserted empty (count = 0) if missing. Valid until the next upsert.
  ChainHead& upsert(uint64_t key) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.empty() ? 16 : slots_.size() * 2);
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(key, mask);; i = (i + 1) & mask) {
      if (slots_[i].key == key) return slots_[i];
      if (slots_[i].key == 0) {
        slots_[i].key = key;
        ++size_;
        return slots_[i];
      }
    }
  }

  // Slot of `key`'s chain head, inserted empty (count = 0) if missing: upsert as an index, which
  // (unlike a reference) can be checked later by `at`.
  uint32_t upsert_slot(uint64_t key) { return static_cast<uint32_t>(&upsert(key) - slots_.data()); }

  // Head of `key` given the slot upsert_slot returned for it. Only a rehash since then moves a
  // head; the table then no longer holds `key` at that slot (a key sits in one slot) and the
  // head is found again.
  ChainHead& at(uint32_t slot, uint64_t key) {
    if (__builtin_expect(slot < slots_.size() && slots_[slot].key == key, 1)) return slots_[slot];
    return upsert(key);
  }

  // Start loading the slot where a lookup of `key` begins (callers batch these ahead of use).
  void prefetch(uint64_t key) const {
    if (!slots_.empty()) prefetch_line(&slots_[home(key, slots_.size() - 1)]);
  }

  // Size the table for `n` keys up front (a rebuild knows its size; doubling would rehash).
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    if (cap > slots_.size()) rehash(cap);
  }

  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    size_ = 0;
  }

  const std::vector<ChainHead, HugePageAllocator<ChainHead>>& slots() const { return slots_; }
  size_t size() const { return size_; }
  size_t memory_bytes() const { return slots_.capacity() * sizeof(ChainHead); }

 private:
  // First slot probed for `key`. Bit 0 of every key is forced to 1 (keys are never 0), so it
  // must not pick the slot: with it, only odd slots would be used and probe runs would grow long.
  // Runs start at the first of the two 32-byte heads of a line, so a probe leaves the line it
  // prefetched only when both heads there hold other keys: on the T=1.0 replay 7% of inserts' and
  // 12% of lookups' probes went on into an unprefetched line, against 11% and 17% from any slot
  // (each such miss stalled the insert or the search).
  static size_t home(uint64_t key, size_t mask) { return (key >> 1) & mask & ~size_t(1); }

  void rehash(size_t cap) {
    std::vector<ChainHead, HugePageAllocator<ChainHead>> old = std::move(slots_);
    slots_.assign(cap, ChainHead{});
    // The occupied slots' indices are packed to the front of a scratch array first, without a
    // branch: about half of the slots are empty, in no predictable pattern, so a test per slot
    // mispredicted every other slot (a request's own tables grow from their first size as it
    // writes, so this runs all the time). Packing 4-byte indices instead of the 32-byte heads
    // themselves writes an eighth of the bytes.
    thread_local std::vector<uint32_t> occupied;
    occupied.resize(old.size());
    size_t n = 0;
    for (size_t i = 0; i < old.size(); ++i) {
      occupied[n] = static_cast<uint32_t>(i);
      n += old[i].key != 0;
    }
    // Moving a large table is a stream of random writes: prefetch a few slots ahead of them.
    // The keys are distinct and the new table has room, so each goes to the first empty slot
    // of its probe run (no key comparison, no growth check, unlike upsert).
    constexpr size_t kAhead = 16;
    const size_t mask = cap - 1;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch_line(&slots_[home(old[occupied[i + kAhead]].key, mask)]);
      const ChainHead& h = old[occupied[i]];
      size_t j = home(h.key, mask);
      while (slots_[j].key != 0) j = (j + 1) & mask;
      slots_[j] = h;
    }
    size_ = n;
    // Kept for the next rehash (most are of small tables), unless a large table's would stay
    // resident for nothing.
    if (occupied.capacity() > kKeepScratch) occupied = {};
  }

  static constexpr size_t kKeepScratch = size_t(1) << 16;  // rehash's scratch kept: 256 KB at most

  std::vector<ChainHead, HugePageAllocator<ChainHead>> slots_;  // linear probing; capacity a power of two
  size_t size_ = 0;               // occupied slots; kept <= half the capacity
};

}  // namespace rollout_spec
