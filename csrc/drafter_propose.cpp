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
}  // namespace

template <class Accept>
void DrafterCore::gather_scope(const ChainIndex& index, int scope, const SlotView& ctx,
                               const ChainHead* const* heads, Accept accept,
                               std::vector<Occurrence>& occ) const {
  const size_t first = occ.size();
  const size_t cap = static_cast<size_t>(cfg_.max_occurrences);
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (occ.size() - first >= static_cast<size_t>(cfg_.enough_occurrences)) break;
    const ChainHead* h = heads[ki];
    if (!h) continue;
    const int32_t need = std::max(std::min(kKeyLens[ki], cfg_.max_match_len), cfg_.min_match_len);
    // Adds the occurrence at (seq, pos) if it qualifies; true once the scope is full.
    auto take = [&](int32_t seq, int32_t pos) {
      // Positions taken through a longer key come back in the shorter keys' chains.
      for (size_t j = first; j < occ.size(); ++j)
        if (occ[j].seq == seq && occ[j].pos == pos) return false;
      const SlotView& v = view_[seq];
      if (pos + 1 >= v.size || !accept(seq)) return false;
      const int32_t m = match_back(ctx, v.tokens, pos, cfg_.max_match_len);
      if (m < need) return false;  // hash collision, or shorter than min_match_len
      Occurrence& o = occ.emplace_back();
      o.seq = seq;
      o.pos = pos;
      o.match_len = m;
      o.scope = scope;
      o.cached = std::min(kCachedNext, v.size - pos - 1);
      std::copy(v.tokens + pos + 1, v.tokens + pos + 1 + o.cached, o.next);
      return occ.size() - first >= cap;
    };
    if (take(h->seq, h->pos)) return;
    int32_t walked = 1;
    // Older records come a block (one cache line) at a time: the next block and the tokens of
    // this block's records are prefetched before any of them is read.
    for (int32_t b = h->block; b >= 0 && walked < cfg_.chain_walk;) {
      const ChainBlock& blk = index.block(ki, b);
      b = blk.prev;
      if (b >= 0) __builtin_prefetch(&index.block(ki, b));
      const int32_t lo = std::max(0, blk.n - (cfg_.chain_walk - walked));
      for (int32_t j = blk.n - 1; j >= lo; --j) __builtin_prefetch(view_[blk.seq[j]].tokens + blk.pos[j]);
      for (int32_t j = blk.n - 1; j >= lo; --j)
        if (take(blk.seq[j], blk.pos[j])) return;
      walked += blk.n - lo;
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
  // The context's keys are looked up in every scope at once, in waves: all table slots are
  // prefetched, then all heads read and their first block and tokens prefetched, so these
  // misses overlap instead of queueing one behind the other.
  uint64_t keys[kNumKeys];
  ngram_keys(ctx.tokens, ctx.size - 1, keys);  // 0 where the context is shorter than the key
  for (const ChainIndex* ix : index)
    if (ix) ix->prefetch(keys);
  const ChainHead* heads[3][kNumKeys];
  for (int sc = 0; sc < 3; ++sc)
    for (int ki = 0; ki < kNumKeys; ++ki) {
      const ChainHead* h = index[sc] && keys[ki] ? index[sc]->head(ki, keys[ki]) : nullptr;
      heads[sc][ki] = h;
      if (!h) continue;
      __builtin_prefetch(view_[h->seq].tokens + h->pos);
      if (h->block >= 0) __builtin_prefetch(&index[sc]->block(ki, h->block));
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
