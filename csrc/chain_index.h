// Hash chains over stored positions, one chain per n-gram, for the key lengths in kKeyLens.
//
// Indexing position p of a sequence (once token p + 1 exists: a record is only useful with a
// continuation) adds, for every key length k <= p + 1, a record to the chain of the k tokens
// ending at p. A chain is walked newest first, so a lookup sees recent rollouts before old ones.
// Two views of the same records are kept: the insertion log (one entry per indexed position,
// shared by all key lengths; used by rebuild, checkpoints and the integrity check) and the
// lookup view (ChainTable heads with the newest record inline, older records in blocks of a
// ChainPool, newest `keep` only, since no search reads further). Records are only appended;
// removal happens by `rebuild`, which re-inserts the kept positions in their original order (so
// recency, and every later proposal, is unaffected by when it ran).
#pragma once

#include "prefetch.h"

#include <cstdint>
#include <functional>
#include <vector>

#include "chain_pool.h"
#include "chain_record.h"
#include "chain_table.h"

namespace rollout_spec {

constexpr int kNumKeys = 3;
// Longest first: lookups try these in order. No 8-gram key: an 8-token match is found through
// its 4-gram chain (and measured backwards), and on the shared traces the extra chain changed no
// proposal outcome while costing a quarter of all inserts.
constexpr int32_t kKeyLens[kNumKeys] = {4, 2, 1};
// A set of key lengths as a bit mask: bit ki stands for kKeyLens[ki].
constexpr uint32_t kAllKeys = (1u << kNumKeys) - 1;

// Hash of tokens[pos-k+1 .. pos] tagged with k; never 0 (0 marks an empty table slot).
uint64_t ngram_key(const int32_t* tokens, int32_t pos, int32_t k);
// keys[ki] = ngram_key(tokens, pos, kKeyLens[ki]) for the key lengths that fit (others 0).
void ngram_keys(const int32_t* tokens, int32_t pos, uint64_t* keys);

class ChainIndex {
 public:
  // Chains keep their newest `keep` (>= 1) records for lookups (the log keeps every one), for
  // the key lengths in `key_mask` only (a non-empty subset of kAllKeys): an index without a
  // key length has no chains for it, and its lookups of that length find nothing.
  explicit ChainIndex(int32_t keep = 32, uint32_t key_mask = kAllKeys)
      : pool_(keep - 1), key_mask_(key_mask) {}

  // Whether this index keeps chains of key length kKeyLens[ki].
  bool has_key(int ki) const { return (key_mask_ >> ki) & 1u; }

  // Index position `pos` of sequence `seq` (whose tokens are `tokens`, holding pos + 1 at least),
  // given its keys from ngram_keys (computed once per position and shared by the request, group
  // and global indexes).
  void insert(int32_t seq, int32_t pos, const int32_t* tokens, const uint64_t* keys);

  // Start loading the table slots that a lookup or insert of these keys will touch.
  void prefetch(const uint64_t* keys) const {
    for (int ki = 0; ki < kNumKeys; ++ki)
      if (keys[ki] != 0 && has_key(ki)) heads_[ki].prefetch(keys[ki]);
  }

  // Start loading this index's own bookkeeping (its tables', pool's and log's fields), which
  // every insert reads: a request's or group's index is cold at each call.
  void prefetch_self() const {
    const char* p = reinterpret_cast<const char*>(this);
    for (size_t off = 0; off < sizeof(*this); off += 64) prefetch_line(p + off);
    prefetch_line(p + sizeof(*this) - 1);
  }
  // Start loading the log's line that the next insert appends to (its fields must be loaded).
  void prefetch_log_end() const {
    if (log_.size() < log_.capacity()) prefetch_line(log_.data() + log_.size());
  }

  // The first half of an insert, run a few positions ahead of `insert(..., slots)`: finds (or
  // makes, with count 0) the heads that inserting these keys updates, stores their table slots
  // in `slots`, and starts loading the block line each insert writes its older record to. Their
  // table slots should be cached by now: call prefetch first, a few positions earlier. The
  // insert then reuses the slots instead of probing the table a second time (each probe ends
  // on an equal or an empty key, an unpredictable branch: a third of extend's mispredictions).
  void prepare(const uint64_t* keys, uint32_t* slots) {
    for (int ki = 0; ki < kNumKeys; ++ki) {
      if (keys[ki] == 0 || !has_key(ki)) continue;
      slots[ki] = heads_[ki].upsert_slot(keys[ki]);
      const ChainHead& h = heads_[ki].slots()[slots[ki]];
      const int32_t older = h.count - 1;  // the older record that insert writes
      if (older <= 0 || pool_.max_older() == 0) continue;
      int32_t cap;
      const ChainEntry* e = pool_.entries(h.block, older, cap);
      prefetch_line(e + older % cap);
    }
  }

  // Index position `pos` like insert above, through the slots that `prepare` stored for these
  // keys (the table may have grown in between: then the heads are found again).
  void insert(int32_t seq, int32_t pos, const int32_t* tokens, const uint64_t* keys,
              const uint32_t* slots);

  // Head of the chain of key length kKeyLens[ki] with this key, or null (always null for a key
  // length this index does not keep).
  const ChainHead* head(int ki, uint64_t key) const {
    return has_key(ki) ? heads_[ki].find(key) : nullptr;
  }

  // The older records kept for chain `h`: the t-th newest of them (t < n) is base[(last - t) % cap].
  struct Older {
    const ChainEntry* base = nullptr;
    int32_t cap = 1;
    int32_t last = 0;  // number of the newest older record, counted from the oldest ever
    int32_t n = 0;     // older records kept
  };
  Older older(const ChainHead& h) const {
    Older o;
    const int32_t older = h.count - 1;
    o.n = std::min(older, pool_.max_older());
    if (o.n <= 0) return o;
    o.base = pool_.entries(h.block, older, o.cap);
    o.last = older - 1;
    return o;
  }
  // Start loading the lines of the newest `n` of those records (every line of the block when
  // they fill it).
  static void prefetch(const Older& o, int32_t n) {
    if (n >= o.cap) {
      const char* p = reinterpret_cast<const char*>(o.base);
      for (int32_t off = 0; off < o.cap * static_cast<int32_t>(sizeof(ChainEntry)); off += 64)
        prefetch_line(p + off);
      return;
    }
    const int32_t m = std::min(n, o.n);
    for (int32_t t = 0, at = m > 0 ? o.last % o.cap : 0; t < m; ++t, at = ring_down(at, o.cap))
      prefetch_line(o.base + at);
  }
  // The ring index before `at` in a block of `cap` entries: (at - 1) mod cap.
  static int32_t ring_down(int32_t at, int32_t cap) { return at == 0 ? cap - 1 : at - 1; }

  // The insertion log: every indexed position, oldest first.
  const std::vector<ChainRecord>& log() const { return log_; }

  // Keep only the positions for which `keep(seq)` holds, in their original order; a no-op when
  // all of them stay (end_step asks every group, and most keep everything).
  void rebuild(const std::function<bool(int32_t)>& keep,
               const std::function<const int32_t*(int32_t)>& tokens_of);

  // Re-index positions exactly as listed, oldest first (used by load).
  void restore(const std::vector<ChainRecord>& log,
               const std::function<const int32_t*(int32_t)>& tokens_of);

  // Size the tables up front for a text of `n` positions (they grow past it as needed): as
  // many keys as positions, but half as many 1-grams (a request's prompt and response hold
  // 36-46% distinct tokens on the shared traces; a table of positions was 2x too large).
  void reserve_positions(size_t n) {
    for (int ki = 0; ki < kNumKeys; ++ki)
      if (has_key(ki)) heads_[ki].reserve(kKeyLens[ki] == 1 ? n / 2 : n);
  }

  // Records over its key lengths (a position counts once per key length that fits).
  size_t num_records() const { return records_; }
  size_t memory_bytes() const;
  bool empty() const { return log_.empty(); }

  // Integrity check: every chain's lookup view lists exactly the log's positions with its key,
  // newest first, with the right neighbouring tokens, and nothing else is listed. The caller
  // checks first that every logged position has a continuation.
  bool check(const std::function<const int32_t*(int32_t)>& tokens_of) const;

 private:
  void insert_record(ChainHead& h, const ChainEntry& e);
  void clear();

  ChainTable heads_[kNumKeys];                // per key length: n-gram key -> chain head
  ChainPool pool_;                            // older records of every chain
  std::vector<ChainRecord> log_;              // indexed positions in insertion order
  size_t records_ = 0;                        // records over its key lengths
  uint32_t key_mask_;                         // the key lengths it keeps (bits of kAllKeys)
};

}  // namespace rollout_spec
