// Proposal path: reuse or rebuild each request's match state, then build its tree.
#include <algorithm>

#include "drafter_core.h"

namespace rollout_spec {

namespace {
// Tokens equal going backwards from ctx's end and from pos, at most `cap`.
inline int32_t match_back(const SlotView& ctx, const int32_t* seq, int32_t pos, int32_t cap) {
  int32_t m = 0;
  const int32_t c = ctx.size - 1;
  while (m < cap && c - m >= 0 && pos - m >= 0 && ctx.tokens[c - m] == seq[pos - m]) ++m;
  return m;
}
constexpr int32_t kWalkBatch = 8;  // chain records fetched ahead of their use
}  // namespace

template <class Accept>
void DrafterCore::gather_scope(const ChainIndex& index, int scope, const SlotView& ctx,
                               const int32_t* heads, Accept accept,
                               std::vector<Occurrence>& occ) const {
  const size_t first = occ.size();
  const size_t cap = static_cast<size_t>(cfg_.max_occurrences);
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const int32_t k = kKeyLens[ki];
    if (occ.size() - first >= static_cast<size_t>(cfg_.enough_occurrences)) break;
    if (k > ctx.size) continue;
    const int32_t need = std::max(std::min(k, cfg_.max_match_len), cfg_.min_match_len);
    // Records are read in small batches: phase 1 follows the chain's links (each a dependent
    // cache miss) and prefetches the tokens every record points at; phase 2 then reads those
    // tokens with their misses overlapped. Batches stop the walk soon after enough were found.
    int32_t r = heads[ki];
    for (int32_t walked = 0; r >= 0 && walked < cfg_.chain_walk;) {
      const int32_t batch = std::min(kWalkBatch, cfg_.chain_walk - walked);
      walk_.clear();
      for (; r >= 0 && static_cast<int32_t>(walk_.size()) < batch; ++walked) {
        const ChainRecord& rec = index.record(ki, r);
        walk_.push_back(rec);
        __builtin_prefetch(view_[rec.seq].tokens + rec.pos);
        r = rec.prev;
      }
      for (const ChainRecord& rec : walk_) {
        // Positions taken through a longer key come back in the shorter keys' chains.
        bool dup = false;
        for (size_t j = first; j < occ.size() && !dup; ++j)
          dup = occ[j].seq == rec.seq && occ[j].pos == rec.pos;
        if (dup) continue;
        const SlotView& v = view_[rec.seq];
        if (rec.pos + 1 >= v.size || !accept(rec.seq)) continue;
        const int32_t m = match_back(ctx, v.tokens, rec.pos, cfg_.max_match_len);
        if (m < need) continue;  // hash collision, or shorter than min_match_len
        occ.push_back(Occurrence{rec.seq, rec.pos, m, scope});
        if (occ.size() - first >= cap) return;
      }
    }
  }
}

void DrafterCore::gather(const RequestState& req, std::vector<Occurrence>& occ) const {
  occ.clear();
  const int32_t own = req.slot;
  const SlotView& ctx = view_[own];
  if (ctx.size == 0) return;
  const int32_t group = seqs_[own].group;
  const bool use_group = group >= 0 && cfg_.scope_weight[1] > 0.0;
  const ChainIndex* index[3] = {cfg_.scope_weight[0] > 0.0 ? &req.own : nullptr, nullptr,
                                cfg_.scope_weight[2] > 0.0 ? &global_ : nullptr};
  if (use_group) {
    auto it = groups_.find(group);
    if (it != groups_.end()) index[1] = &it->second;
  }
  // The context's keys are looked up in every scope at once: first all hash slots are
  // prefetched, then all chain heads, so these misses overlap instead of queueing.
  uint64_t keys[kNumKeys];
  ngram_keys(ctx.tokens, ctx.size - 1, keys);  // 0 where the context is shorter than the key
  for (const ChainIndex* ix : index)
    if (ix) ix->prefetch(keys);
  int32_t heads[3][kNumKeys];
  for (int sc = 0; sc < 3; ++sc)
    for (int ki = 0; ki < kNumKeys; ++ki) {
      heads[sc][ki] = index[sc] && keys[ki] ? index[sc]->head(ki, keys[ki]) : -1;
      if (heads[sc][ki] >= 0) __builtin_prefetch(&index[sc]->record(ki, heads[sc][ki]));
    }
  if (index[0]) gather_scope(*index[0], 0, ctx, heads[0], [](int32_t) { return true; }, occ);
  if (index[1])
    gather_scope(*index[1], 1, ctx, heads[1],
                 [&](int32_t seq) { return in_group_scope(seq, own, group); }, occ);
  if (index[2])
    gather_scope(*index[2], 2, ctx, heads[2],
                 [&](int32_t seq) {
                   return seq != own && !(use_group && in_group_scope(seq, own, group));
                 },
                 occ);
}

void DrafterCore::propose(const int64_t* ids, const int32_t* budgets, size_t n, DraftOutput& out) {
  std::lock_guard<std::mutex> lock(mu_);
  resolve(ids, n);
  out = DraftOutput{};
  out.offsets.reserve(n + 1);
  int64_t left = cfg_.max_batch_draft_tokens;
  for (size_t i = 0; i < n; ++i) {
    int64_t want = budgets ? budgets[i] : cfg_.num_draft_tokens;
    int32_t budget = static_cast<int32_t>(std::min<int64_t>(want, left));
    RequestState& req = *reqs_[i];
    if (budget <= 0) {
      out.offsets.push_back(out.offsets.back());
      continue;
    }
    ++proposals_;
    if (!req.gathered || req.since_gather >= cfg_.regather_every ||
        static_cast<int32_t>(req.occ.size()) < cfg_.regather_below) {
      gather(req, req.occ);
      req.gathered = true;
      req.since_gather = 0;
      ++gathers_;
    }
    builder_.build(req.occ, view_, cfg_, budget, out);
    left -= out.offsets.back() - out.offsets[out.offsets.size() - 2];
  }
}

}  // namespace rollout_spec
