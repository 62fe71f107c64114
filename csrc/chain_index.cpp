#include "chain_index.h"

#include <algorithm>
#include <unordered_map>

namespace rollout_spec {

namespace {
// ngram_key's body, inlined where k is a constant so that its loop unrolls (ngram_keys, which
// extend and every search run on each position).
__attribute__((always_inline)) inline uint64_t mix_ngram(const int32_t* tokens, int32_t pos, int32_t k) {
  // FNV-style mixing with a final avalanche (splitmix64); k is mixed in so that the chains of
  // different key lengths never share a key.
  uint64_t h = 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(k + 1);
  for (int32_t i = pos - k + 1; i <= pos; ++i) {
    h ^= static_cast<uint32_t>(tokens[i]);
    h *= 0x100000001B3ULL;
    h = (h << 29) | (h >> 35);
  }
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBULL;
  h ^= h >> 31;
  return h | 1;
}
}  // namespace

uint64_t ngram_key(const int32_t* tokens, int32_t pos, int32_t k) { return mix_ngram(tokens, pos, k); }

void ngram_keys(const int32_t* tokens, int32_t pos, uint64_t* keys) {
#pragma GCC unroll 3
  for (int ki = 0; ki < kNumKeys; ++ki)
    keys[ki] = pos + 1 >= kKeyLens[ki] ? mix_ngram(tokens, pos, kKeyLens[ki]) : 0;
}

// Inlined into both inserts: a call per record cost about as many instructions (saved
// registers) as the record's own work.
inline void ChainIndex::insert_record(ChainHead& h, const ChainEntry& e) {
  if (h.count > 0) pool_.put(h.block, h.count - 1, h.newest);  // the old head becomes older
  h.newest = e;
  ++h.count;
  ++records_;
}

void ChainIndex::insert(int32_t seq, int32_t pos, const int32_t* tokens, const uint64_t* keys) {
  log_.push_back(ChainRecord{seq, pos});
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (keys[ki] == 0 || !has_key(ki)) continue;
    const int32_t k = kKeyLens[ki];
    insert_record(heads_[ki].upsert(keys[ki]),
                  ChainEntry{seq, pos, pos >= k ? tokens[pos - k] : -1, tokens[pos + 1]});
  }
}

void ChainIndex::insert(int32_t seq, int32_t pos, const int32_t* tokens, const uint64_t* keys,
                        const uint32_t* slots) {
  log_.push_back(ChainRecord{seq, pos});
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (keys[ki] == 0 || !has_key(ki)) continue;
    const int32_t k = kKeyLens[ki];
    insert_record(heads_[ki].at(slots[ki], keys[ki]),
                  ChainEntry{seq, pos, pos >= k ? tokens[pos - k] : -1, tokens[pos + 1]});
  }
}

void ChainIndex::clear() {
  for (int ki = 0; ki < kNumKeys; ++ki) heads_[ki].clear();
  pool_.clear();
  log_ = {};
  records_ = 0;
}

void ChainIndex::rebuild(const std::function<bool(int32_t)>& keep,
                         const std::function<const int32_t*(int32_t)>& tokens_of) {
  // Records come in runs of one sequence, so `keep` is asked once per run.
  int32_t seq = -1;
  bool keeps = false;
  auto kept_record = [&](const ChainRecord& r) {
    if (r.seq != seq) keeps = keep(seq = r.seq);
    return keeps;
  };
  size_t kept = 0;
  for (const ChainRecord& r : log_) kept += kept_record(r);
  if (kept == log_.size()) return;  // nothing leaves: the index would come out the same
  // Each table gets room for the keys it held (an upper bound on the kept ones, unlike the
  // kept positions: on the shared T=0.6 trace a group's 1-gram table holds ~20x fewer keys than
  // its positions, its 2-gram table ~7x).
  size_t keys[kNumKeys];
  for (int ki = 0; ki < kNumKeys; ++ki) keys[ki] = std::min(kept, heads_[ki].size());
  std::vector<ChainRecord> old = std::move(log_);
  clear();
  log_.reserve(kept);
  for (int ki = 0; ki < kNumKeys; ++ki)
    if (has_key(ki)) heads_[ki].reserve(keys[ki]);
  uint64_t hashes[kNumKeys];
  for (const ChainRecord& r : old) {
    if (!kept_record(r)) continue;
    const int32_t* tokens = tokens_of(r.seq);
    ngram_keys(tokens, r.pos, hashes);
    insert(r.seq, r.pos, tokens, hashes);
  }
}

void ChainIndex::restore(const std::vector<ChainRecord>& log,
                         const std::function<const int32_t*(int32_t)>& tokens_of) {
  clear();
  log_.reserve(log.size());
  uint64_t keys[kNumKeys];
  for (const ChainRecord& r : log) {
    const int32_t* tokens = tokens_of(r.seq);
    ngram_keys(tokens, r.pos, keys);
    insert(r.seq, r.pos, tokens, keys);
  }
}

size_t ChainIndex::memory_bytes() const {
  size_t n = sizeof(*this) + log_.capacity() * sizeof(ChainRecord) + pool_.memory_bytes();
  for (int ki = 0; ki < kNumKeys; ++ki) n += heads_[ki].memory_bytes();
  return n;
}

bool ChainIndex::check(const std::function<const int32_t*(int32_t)>& tokens_of) const {
  size_t total = 0;
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const int32_t k = kKeyLens[ki];
    if (!has_key(ki)) {  // a key length it does not keep has no chains
      for (const ChainHead& h : heads_[ki].slots())
        if (h.key != 0) return false;
      continue;
    }
    // The log's positions of every key, oldest first: the key's lookup view must list the newest.
    std::unordered_map<uint64_t, std::vector<ChainRecord>> expected;
    for (const ChainRecord& r : log_)
      if (r.pos + 1 >= k) expected[ngram_key(tokens_of(r.seq), r.pos, k)].push_back(r);
    auto same = [&](const ChainEntry& e, const ChainRecord& r) {
      if (r.seq != e.seq || r.pos != e.pos) return false;
      const int32_t* t = tokens_of(e.seq);
      return e.before == (e.pos >= k ? t[e.pos - k] : -1) && e.after == t[e.pos + 1];
    };
    size_t chains = 0;
    for (const ChainHead& h : heads_[ki].slots()) {
      if (h.key == 0) continue;
      auto it = expected.find(h.key);
      if (it == expected.end() || static_cast<size_t>(h.count) != it->second.size()) return false;
      const std::vector<ChainRecord>& want = it->second;
      if (!same(h.newest, want.back())) return false;
      const Older o = older(h);
      if (o.n != std::min<int32_t>(h.count - 1, pool_.max_older())) return false;
      for (int32_t t = 0; t < o.n; ++t)
        if (!same(o.base[(o.last - t) % o.cap], want[want.size() - 2 - t])) return false;
      ++chains;
      total += want.size();
    }
    if (chains != expected.size()) return false;
  }
  return total == records_;
}

}  // namespace rollout_spec
