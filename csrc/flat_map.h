// Open-addressing hash map from a non-zero 64-bit key to an int32 value (the newest record of a
// chain). std::unordered_map allocates one node per key; this keeps keys and values in one flat
// array, which matters because every stored token adds up to four keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rollout_spec {

class FlatMap {
 public:
  static constexpr int32_t kMissing = -1;

  // Value stored for `key`, or kMissing.
  int32_t get(uint64_t key) const {
    if (slots_.empty()) return kMissing;
    size_t mask = slots_.size() - 1;
    for (size_t i = key & mask;; i = (i + 1) & mask) {
      if (slots_[i].key == key) return slots_[i].val;
      if (slots_[i].key == 0) return kMissing;
    }
  }

  // Start loading the slot where a lookup of `key` begins (callers batch these ahead of use).
  void prefetch(uint64_t key) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[key & (slots_.size() - 1)]);
  }

  // Insert or overwrite; returns the previous value (kMissing when the key was new).
  int32_t put(uint64_t key, int32_t value) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.empty() ? 16 : slots_.size() * 2);
    size_t mask = slots_.size() - 1;
    for (size_t i = key & mask;; i = (i + 1) & mask) {
      if (slots_[i].key == key) {
        int32_t old = slots_[i].val;
        slots_[i].val = value;
        return old;
      }
      if (slots_[i].key == 0) {
        slots_[i] = Slot{key, value};
        ++size_;
        return kMissing;
      }
    }
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

  size_t size() const { return size_; }
  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  // Key and value side by side: a lookup touches one cache line, not two.
  struct Slot {
    uint64_t key = 0;  // 0 marks an empty slot (hashes are never 0)
    int32_t val = kMissing;
  };

  void rehash(size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    size_ = 0;
    for (const Slot& e : old)
      if (e.key != 0) put(e.key, e.val);
  }

  std::vector<Slot> slots_;  // open addressing, linear probing; capacity a power of two
  size_t size_ = 0;          // occupied slots; kept <= half the capacity
};

}  // namespace rollout_spec
