// Hash chains over stored positions, one chain per n-gram, for the key lengths in kKeyLens.
//
// Inserting position p of a sequence adds, for every key length k <= p + 1, a record to the
// chain of the k tokens ending at p. A chain is walked newest first, so a lookup sees recent
// rollouts before old ones. Two views of the same records are kept: the insertion log (each
// record linked to the previous one of its key; used by rebuild, checkpoints and the integrity
// check) and the lookup view (ChainTable heads with the newest record inline, older records in
// blocks of kChainBlock). Records are only appended; removal happens by `rebuild`, which
// re-inserts the kept records in their original order (so recency, and every later proposal,
// is unaffected by when it ran).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "chain_record.h"
#include "chain_table.h"

namespace rollout_spec {

constexpr int kNumKeys = 3;
// Longest first: lookups try these in order. No 8-gram key: an 8-token match is found through
// its 4-gram chain (and measured backwards), and on the shared traces the extra chain changed no
// proposal outcome while costing a quarter of all inserts.
constexpr int32_t kKeyLens[kNumKeys] = {4, 2, 1};

// Hash of tokens[pos-k+1 .. pos] tagged with k; never 0 (0 marks an empty table slot).
uint64_t ngram_key(const int32_t* tokens, int32_t pos, int32_t k);
// keys[ki] = ngram_key(tokens, pos, kKeyLens[ki]) for the key lengths that fit (others 0).
void ngram_keys(const int32_t* tokens, int32_t pos, uint64_t* keys);

class ChainIndex {
 public:
  // Add records for position `pos` of sequence `seq`, given its keys from ngram_keys (computed
  // once per position and shared by the request, group and global indexes).
  void insert_keys(int32_t seq, int32_t pos, const uint64_t* keys);

  // Start loading the table slots that a lookup or insert of these keys will touch.
  void prefetch(const uint64_t* keys) const {
    for (int ki = 0; ki < kNumKeys; ++ki)
      if (keys[ki] != 0) heads_[ki].prefetch(keys[ki]);
  }

  // Start loading the blocks and log ends that an insert of these keys writes (their table
  // slots should be cached by now: call prefetch first, a few positions earlier).
  void prefetch_tails(const uint64_t* keys) const {
    for (int ki = 0; ki < kNumKeys; ++ki) {
      if (keys[ki] == 0) continue;
      const ChainHead* h = heads_[ki].find(keys[ki]);
      if (h && h->block >= 0) __builtin_prefetch(&blocks_[ki][h->block]);
      __builtin_prefetch(recs_[ki].data() + recs_[ki].size());
    }
  }

  // Head of the chain of key length kKeyLens[ki] with this key, or null.
  const ChainHead* head(int ki, uint64_t key) const { return heads_[ki].find(key); }
  const ChainBlock& block(int ki, int32_t b) const { return blocks_[ki][b]; }

  // The insertion log of key length kKeyLens[ki].
  const std::vector<ChainRecord>& records(int ki) const { return recs_[ki]; }

  // Keep only the records for which `keep(seq)` holds, in their original order.
  void rebuild(const std::function<bool(int32_t)>& keep,
               const std::function<const int32_t*(int32_t)>& tokens_of);

  // Re-insert records exactly as listed (used by load); `recs` hold seq/pos, prev is recomputed.
  void restore(int ki, const std::vector<ChainRecord>& recs, const int32_t* const* tokens_by_seq);

  size_t num_records() const;
  size_t memory_bytes() const;
  bool empty() const { return num_records() == 0; }

  // Integrity check: log links point backwards to records of the same key, and every chain's
  // lookup view lists exactly its log records, newest first.
  bool check(const std::function<const int32_t*(int32_t)>& tokens_of) const;

 private:
  void insert(int ki, uint64_t key, int32_t seq, int32_t pos);

  ChainTable heads_[kNumKeys];                // per key length: n-gram key -> chain head
  std::vector<ChainBlock> blocks_[kNumKeys];  // per key length: blocks of older records
  std::vector<ChainRecord> recs_[kNumKeys];   // per key length: insertion log
};

}  // namespace rollout_spec
