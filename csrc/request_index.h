// A request's own index (the request scope): every position of its prompt and response so far,
// in the chain of the n-gram ending there, for the key lengths of kRequestKeys.
//
// Why not a ChainIndex: every record of this index lies in the request's own sequence, indexed
// in order, so a chain can be a list through a per-position array (`prev`: the position before
// it with the same key), and a table slot needs only the chain's newest position and a check of
// its key (8 bytes, against a ChainIndex's 32-byte head, 16-byte pooled records and 8-byte log
// entry). The tokens a search reads around a record (the one before its n-gram, the one after)
// are the request's own, read from its sequence instead of being copied into the record. On the
// shared T=0.6 trace, 512 live requests held ~22 MB of own ChainIndexes, cold at every call and
// mostly fresh memory (whose first touch a VM makes costly); this holds the same chains in 30%
// of that (docs/drafter.md).
//
// A slot knows its key by 32 bits of the key's hash only (its home slot is taken from them,
// so the table can grow without the keys), so two keys of a request may share a chain: a search
// checks each position's n-gram against the context's (the tokens are read for the record
// anyway), which makes lookups exact, unlike the shared indexes, which trust the 64-bit hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "chain_index.h"
#include "huge_pages.h"
#include "prefetch.h"

namespace rollout_spec {

class RequestIndex {
 public:
  // An index of the key lengths in `key_mask` (a non-empty subset of kAllKeys).
  explicit RequestIndex(uint32_t key_mask = kAllKeys) : key_mask_(key_mask) {}

  // Whether this index keeps chains of key length kKeyLens[ki].
  bool has_key(int ki) const { return (key_mask_ >> ki) & 1u; }

  // Positions indexed so far: positions 0 .. size() - 1 of the request's sequence.
  int32_t size() const { return size_; }

  // Size the tables and chains for `n` positions up front (they grow past it as needed): as
  // many keys as positions, half as many 1-grams (see ChainIndex::reserve_positions).
  void reserve_positions(size_t n);

  // Index the next position (size()), whose keys are `keys` (ngram_keys at that position):
  // prepare and insert below at once.
  void insert(const uint64_t* keys);
  // Index positions size() .. n - 1 of `tokens` (which hold n + 1 tokens at least).
  void insert_up_to(const int32_t* tokens, int32_t n);

  // Start loading the table slots that a lookup or insert of these keys will touch.
  void prefetch(const uint64_t* keys) const {
    for (int ki = 0; ki < kNumKeys; ++ki)
      if (keys[ki] != 0 && has_key(ki) && !slots_[ki].empty()) prefetch_line(&slots_[ki][home(check(keys[ki]), ki)]);
  }
  // Start loading this index's own fields, which every insert reads (cold at each call).
  void prefetch_self() const {
    const char* p = reinterpret_cast<const char*>(this);
    for (size_t off = 0; off < sizeof(*this); off += 64) prefetch_line(p + off);
    prefetch_line(p + sizeof(*this) - 1);
  }
  // Start loading the chain entries that inserting position `pos` writes.
  void prefetch_entries(int32_t pos) const {
    for (int ki = 0; ki < kNumKeys; ++ki)
      if (has_key(ki) && pos < static_cast<int32_t>(prev_[ki].capacity())) prefetch_line(prev_[ki].data() + pos);
  }

  // The first half of an insert, run a few positions ahead of `insert(keys, slots)`: finds (or
  // makes, empty) the slots that inserting these keys updates and stores them in `slots`, so
  // that the insert does not probe the table again (as ChainIndex::prepare).
  void prepare(const uint64_t* keys, uint32_t* slots);
  // Index the next position like insert above, through the slots `prepare` stored for these
  // keys (the table may have grown in between: then the slots are found again).
  void insert(const uint64_t* keys, const uint32_t* slots);

  // The newest position of the chain of key length kKeyLens[ki] that holds this key, or -1
  // (the chain may also hold another key's positions: see the top of this file).
  int32_t newest(int ki, uint64_t key) const {
    if (!has_key(ki) || slots_[ki].empty()) return -1;
    const std::vector<Slot, HugePageAllocator<Slot>>& t = slots_[ki];
    const uint32_t c = check(key);
    const size_t mask = t.size() - 1;
    for (size_t i = home(c, ki);; i = (i + 1) & mask) {
      if (t[i].check == c) return t[i].pos;
      if (t[i].check == 0) return -1;
    }
  }
  // The position before `pos` in its chain of key length kKeyLens[ki], or -1.
  int32_t older(int ki, int32_t pos) const { return prev_[ki][pos]; }
  // Start loading the chain entry of `pos` (an older() of it follows).
  void prefetch_older(int ki, int32_t pos) const { prefetch_line(prev_[ki].data() + pos); }

  // Records over its key lengths (a position counts once per key length that fits).
  size_t num_records() const { return records_; }
  size_t memory_bytes() const;

  // Integrity check against the request's tokens (at least size() + 1 of them): every chain
  // lists exactly the positions whose key has its check, newest first, and nothing else.
  bool check(const int32_t* tokens) const;

 private:
  struct Slot {
    uint32_t check = 0;  // check() of its keys; 0 marks an empty slot
    int32_t pos = -1;    // its chain's newest position, -1 while a prepared slot has none yet
  };
  // 32 bits of the key's hash (bit 0 of every key is 1, so it is left out); 0 is kept for
  // empty slots and taken as 1.
  static uint32_t check(uint64_t key) {
    const uint32_t c = static_cast<uint32_t>(key >> 1);
    return c != 0 ? c : 1u;
  }
  size_t home(uint32_t check, int ki) const { return check & (slots_[ki].size() - 1); }
  // The slot of `key` in table ki, claimed (with no position) if missing; grows the table
  // first when it would pass half full.
  uint32_t upsert(int ki, uint64_t key);
  // Move table ki's slots into a table of `cap` (a power of two) slots: a slot's home comes
  // from its check, so no key is needed.
  void rehash(int ki, size_t cap);
  // Link the next position into the chain whose slot is `slot`.
  void link(int ki, Slot& slot);

  std::vector<Slot, HugePageAllocator<Slot>> slots_[kNumKeys];      // per key length: open addressing
  std::vector<int32_t, HugePageAllocator<int32_t>> prev_[kNumKeys];  // per key length, per position
  size_t used_[kNumKeys] = {};  // occupied slots per table, kept <= half its size
  size_t records_ = 0;          // records over its key lengths
  int32_t size_ = 0;            // positions indexed
  uint32_t key_mask_;           // the key lengths it keeps (bits of kAllKeys)
};

}  // namespace rollout_spec
