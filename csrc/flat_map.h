// Open-addressing hash map from a non-zero 64-bit key to an int32 value (the newest record of a
// chain). std::unordered_map allocates one node per key; this keeps keys and values in two flat
// arrays, which matters because every stored token adds up to four keys.
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
    if (keys_.empty()) return kMissing;
    size_t mask = keys_.size() - 1;
    for (size_t i = key & mask;; i = (i + 1) & mask) {
      if (keys_[i] == key) return vals_[i];
      if (keys_[i] == 0) return kMissing;
    }
  }

  // Insert or overwrite; returns the previous value (kMissing when the key was new).
  int32_t put(uint64_t key, int32_t value) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    size_t mask = keys_.size() - 1;
    for (size_t i = key & mask;; i = (i + 1) & mask) {
      if (keys_[i] == key) {
        int32_t old = vals_[i];
        vals_[i] = value;
        return old;
      }
      if (keys_[i] == 0) {
        keys_[i] = key;
        vals_[i] = value;
        ++size_;
        return kMissing;
      }
    }
  }

  // Size the table for `n` keys up front (a rebuild knows its size; doubling would rehash).
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    if (cap > keys_.size()) {
      std::vector<uint64_t> old_keys = std::move(keys_);
      std::vector<int32_t> old_vals = std::move(vals_);
      keys_.assign(cap, 0);
      vals_.assign(cap, kMissing);
      size_ = 0;
      for (size_t i = 0; i < old_keys.size(); ++i)
        if (old_keys[i] != 0) put(old_keys[i], old_vals[i]);
    }
  }

  void clear() {
    keys_.clear();
    vals_.clear();
    keys_.shrink_to_fit();
    vals_.shrink_to_fit();
    size_ = 0;
  }

  size_t size() const { return size_; }
  size_t memory_bytes() const { return keys_.capacity() * sizeof(uint64_t) + vals_.capacity() * sizeof(int32_t); }

 private:
  void grow() {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<int32_t> old_vals = std::move(vals_);
    size_t cap = old_keys.empty() ? 16 : old_keys.size() * 2;
    keys_.assign(cap, 0);
    vals_.assign(cap, kMissing);
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != 0) put(old_keys[i], old_vals[i]);
  }

  std::vector<uint64_t> keys_;  // slot keys; 0 marks an empty slot (hashes are never 0)
  std::vector<int32_t> vals_;   // slot values, meaningful where keys_ is non-zero
  size_t size_ = 0;             // occupied slots; kept <= half the capacity
};

}  // namespace rollout_spec
