#include "chain_index.h"

namespace rollout_spec {

uint64_t ngram_key(const int32_t* tokens, int32_t pos, int32_t k) {
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

void ngram_keys(const int32_t* tokens, int32_t pos, uint64_t* keys) {
  for (int ki = 0; ki < kNumKeys; ++ki)
    keys[ki] = pos + 1 >= kKeyLens[ki] ? ngram_key(tokens, pos, kKeyLens[ki]) : 0;
}

void ChainIndex::insert(int ki, uint64_t key, int32_t seq, int32_t pos) {
  ChainHead& h = heads_[ki].upsert(key);
  std::vector<ChainBlock>& blocks = blocks_[ki];
  if (h.newest >= 0) {  // the current head record moves into the newest block
    if (h.block < 0 || blocks[h.block].n == kChainBlock) {
      ChainBlock fresh;
      fresh.prev = h.block;
      blocks.push_back(fresh);
      h.block = static_cast<int32_t>(blocks.size()) - 1;
    }
    ChainBlock& b = blocks[h.block];
    b.seq[b.n] = h.seq;
    b.pos[b.n] = h.pos;
    ++b.n;
  }
  recs_[ki].push_back(ChainRecord{seq, pos, h.newest});
  h.newest = static_cast<int32_t>(recs_[ki].size()) - 1;
  h.seq = seq;
  h.pos = pos;
}

void ChainIndex::insert_keys(int32_t seq, int32_t pos, const uint64_t* keys) {
  for (int ki = 0; ki < kNumKeys; ++ki)
    if (keys[ki] != 0) insert(ki, keys[ki], seq, pos);
}

void ChainIndex::rebuild(const std::function<bool(int32_t)>& keep,
                         const std::function<const int32_t*(int32_t)>& tokens_of) {
  for (int ki = 0; ki < kNumKeys; ++ki) {
    std::vector<ChainRecord> old = std::move(recs_[ki]);
    recs_[ki] = {};
    blocks_[ki] = {};
    heads_[ki].clear();
    size_t kept = 0;
    for (const ChainRecord& r : old) kept += keep(r.seq);
    recs_[ki].reserve(kept);
    heads_[ki].reserve(kept);  // an upper bound on distinct keys
    for (const ChainRecord& r : old)
      if (keep(r.seq)) insert(ki, ngram_key(tokens_of(r.seq), r.pos, kKeyLens[ki]), r.seq, r.pos);
  }
}

void ChainIndex::restore(int ki, const std::vector<ChainRecord>& recs,
                         const int32_t* const* tokens_by_seq) {
  recs_[ki].clear();
  blocks_[ki].clear();
  heads_[ki].clear();
  recs_[ki].reserve(recs.size());
  for (const ChainRecord& r : recs)
    insert(ki, ngram_key(tokens_by_seq[r.seq], r.pos, kKeyLens[ki]), r.seq, r.pos);
}

size_t ChainIndex::num_records() const {
  size_t n = 0;
  for (const auto& r : recs_) n += r.size();
  return n;
}

size_t ChainIndex::memory_bytes() const {
  size_t n = sizeof(*this);
  for (int ki = 0; ki < kNumKeys; ++ki)
    n += heads_[ki].memory_bytes() + recs_[ki].capacity() * sizeof(ChainRecord) +
         blocks_[ki].capacity() * sizeof(ChainBlock);
  return n;
}

bool ChainIndex::check(const std::function<const int32_t*(int32_t)>& tokens_of) const {
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const auto& recs = recs_[ki];
    for (size_t i = 0; i < recs.size(); ++i) {
      const ChainRecord& r = recs[i];
      if (r.pos + 1 < kKeyLens[ki]) return false;
      const uint64_t key = ngram_key(tokens_of(r.seq), r.pos, kKeyLens[ki]);
      if (r.prev >= static_cast<int32_t>(i)) return false;
      if (r.prev >= 0 && ngram_key(tokens_of(recs[r.prev].seq), recs[r.prev].pos, kKeyLens[ki]) != key)
        return false;
      const ChainHead* h = heads_[ki].find(key);  // the newest record of each key is the head
      if (!h || h->newest < static_cast<int32_t>(i)) return false;
    }
    size_t listed = 0;
    for (const ChainHead& h : heads_[ki].slots()) {
      if (h.key == 0) continue;
      // The lookup view, newest first, must equal the log's chain from the head record.
      int32_t r = h.newest;
      if (r < 0 || recs[r].seq != h.seq || recs[r].pos != h.pos) return false;
      r = recs[r].prev;
      ++listed;
      for (int32_t b = h.block; b >= 0; b = blocks_[ki][b].prev) {
        const ChainBlock& blk = blocks_[ki][b];
        for (int32_t j = blk.n - 1; j >= 0; --j, r = recs[r].prev, ++listed)
          if (r < 0 || recs[r].seq != blk.seq[j] || recs[r].pos != blk.pos[j]) return false;
      }
      if (r != -1) return false;
    }
    if (listed != recs.size()) return false;
  }
  return true;
}

}  // namespace rollout_spec
