#include "request_index.h"

#include <algorithm>
#include <map>

namespace rollout_spec {

void RequestIndex::reserve_positions(size_t n) {
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (!has_key(ki)) continue;
    const size_t keys = kKeyLens[ki] == 1 ? n / 2 : n;
    size_t cap = 16;
    while (cap < 2 * keys) cap *= 2;
    if (cap > slots_[ki].size()) rehash(ki, cap);
    prev_[ki].reserve(n);
  }
}

uint32_t RequestIndex::upsert(int ki, uint64_t key) {
  if ((used_[ki] + 1) * 2 > slots_[ki].size()) rehash(ki, slots_[ki].empty() ? 16 : slots_[ki].size() * 2);
  std::vector<Slot, HugePageAllocator<Slot>>& t = slots_[ki];
  const uint32_t c = check(key);
  const size_t mask = t.size() - 1;
  for (size_t i = home(c, ki);; i = (i + 1) & mask) {
    if (t[i].check == c) return static_cast<uint32_t>(i);
    if (t[i].check == 0) {
      t[i].check = c;
      t[i].pos = -1;
      ++used_[ki];
      return static_cast<uint32_t>(i);
    }
  }
}

void RequestIndex::rehash(int ki, size_t cap) {
  std::vector<Slot, HugePageAllocator<Slot>> old = std::move(slots_[ki]);
  slots_[ki].assign(cap, Slot{});
  const size_t mask = cap - 1;
  for (const Slot& s : old) {
    if (s.check == 0) continue;
    size_t i = home(s.check, ki);
    while (slots_[ki][i].check != 0) i = (i + 1) & mask;
    slots_[ki][i] = s;
  }
}

inline void RequestIndex::link(int ki, Slot& slot) {
  prev_[ki].push_back(slot.pos);
  slot.pos = size_;
  ++records_;
}

void RequestIndex::insert(const uint64_t* keys) {
  uint32_t slots[kNumKeys];
  prepare(keys, slots);
  insert(keys, slots);
}

void RequestIndex::insert_up_to(const int32_t* tokens, int32_t n) {
  uint64_t keys[kNumKeys];
  while (size_ < n) {
    ngram_keys(tokens, size_, keys);
    insert(keys);
  }
}

void RequestIndex::prepare(const uint64_t* keys, uint32_t* slots) {
  for (int ki = 0; ki < kNumKeys; ++ki)
    if (keys[ki] != 0 && has_key(ki)) slots[ki] = upsert(ki, keys[ki]);
}

void RequestIndex::insert(const uint64_t* keys, const uint32_t* slots) {
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (!has_key(ki)) continue;
    if (keys[ki] == 0) {  // the key does not fit before this position
      prev_[ki].push_back(-1);
      continue;
    }
    // Only a rehash since prepare moves a slot; the slot then holds another check or none.
    const uint32_t c = check(keys[ki]);
    const uint32_t at = slots[ki];
    const bool kept = __builtin_expect(at < slots_[ki].size() && slots_[ki][at].check == c, 1);
    link(ki, slots_[ki][kept ? at : upsert(ki, keys[ki])]);
  }
  ++size_;
}

size_t RequestIndex::memory_bytes() const {
  size_t n = sizeof(*this);
  for (int ki = 0; ki < kNumKeys; ++ki)
    n += slots_[ki].capacity() * sizeof(Slot) + prev_[ki].capacity() * sizeof(int32_t);
  return n;
}

bool RequestIndex::check(const int32_t* tokens) const {
  size_t total = 0;
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const int32_t k = kKeyLens[ki];
    if (!has_key(ki)) {
      if (!slots_[ki].empty() || !prev_[ki].empty()) return false;
      continue;
    }
    if (static_cast<int32_t>(prev_[ki].size()) != size_) return false;
    // Per check, the positions whose key has it, oldest first.
    std::map<uint32_t, std::vector<int32_t>> expected;
    for (int32_t p = k - 1; p < size_; ++p) expected[check(ngram_key(tokens, p, k))].push_back(p);
    size_t chains = 0;
    for (size_t i = 0; i < slots_[ki].size(); ++i) {
      const Slot& s = slots_[ki][i];
      if (s.check == 0) continue;
      auto it = expected.find(s.check);
      if (it == expected.end()) return false;
      // Reachable from its home without crossing an empty slot.
      for (size_t j = home(s.check, ki); j != i; j = (j + 1) & (slots_[ki].size() - 1))
        if (slots_[ki][j].check == 0) return false;
      const std::vector<int32_t>& want = it->second;
      int32_t p = s.pos;
      for (auto w = want.rbegin(); w != want.rend(); ++w, p = prev_[ki][p])
        if (p != *w) return false;
      if (p != -1) return false;
      ++chains;
      total += want.size();
    }
    if (chains != expected.size() || chains != used_[ki]) return false;
    // Positions too early for the key are in no chain.
    for (int32_t p = 0; p < std::min(k - 1, size_); ++p)
      if (prev_[ki][p] != -1) return false;
  }
  return total == records_;
}

}  // namespace rollout_spec
