// Proposal path: reuse or rebuild each request's match state, then build its tree.
#include "prefetch.h"
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
  const int32_t c = ctx.size - 1;
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (occ.size() - first >= static_cast<size_t>(cfg_.enough_occurrences)) break;
    const ChainHead* h = heads[ki];
    if (!h) continue;
    const int32_t k = kKeyLens[ki];
    const int32_t need = std::max(std::min(k, cfg_.max_match_len), cfg_.min_match_len);
    // True when the record's match goes on past the key: the token before its n-gram equals the
    // context's. Otherwise the match is exactly k tokens long, known without reading the record's
    // sequence (the key's own tokens are trusted to the 64-bit hash).
    auto longer = [&](int32_t before) { return before >= 0 && c >= k && ctx.tokens[c - k] == before; };
    // Adds the occurrence of a record if it qualifies; true once the scope is full.
    auto take = [&](const ChainEntry& e) {
      const int32_t seq = e.seq, pos = e.pos;
      if (!accept(seq)) return false;
      int32_t m = std::min(k, cfg_.max_match_len);
      int32_t cached = 1;
      if (longer(e.before)) {
        // Only a match longer than k can have been taken already through a longer key.
        for (size_t j = first; j < occ.size(); ++j)
          if (occ[j].seq == seq && occ[j].pos == pos) return false;
        const SlotView& v = view_[seq];
        m = match_back(ctx, v.tokens, pos, cfg_.max_match_len);
        cached = std::min(kCachedNext, v.size - pos - 1);  // its line is loaded now anyway
      }
      if (m < need) return false;  // shorter than min_match_len
      Occurrence& o = occ.emplace_back();
      o.seq = seq;
      o.pos = pos;
      o.match_len = m;
      o.scope = scope;
      o.cached = cached;
      o.next[0] = e.after;
      for (int32_t d = 1; d < cached; ++d) o.next[d] = view_[seq].tokens[pos + 1 + d];
      return occ.size() - first >= cap;
    };
    if (take(h->newest)) return;
    // The older records kept sit in one block, whose lines were prefetched with the heads.
    const ChainIndex::Older older = index.older(*h);
    const int32_t n = std::min(older.n, cfg_.chain_walk - 1);
    for (int32_t t = 0; t < n; ++t) {
      const ChainEntry& e = older.base[(older.last - t) % older.cap];
      if (longer(e.before)) prefetch_line(view_[e.seq].tokens + e.pos);
    }
    for (int32_t t = 0; t < n; ++t)
      if (take(older.base[(older.last - t) % older.cap])) return;
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
      // The head's tokens are read only if its match is longer than the key.
      const ChainEntry& e = h->newest;
      if (e.before >= 0 && ctx.size > kKeyLens[ki] && ctx.tokens[ctx.size - 1 - kKeyLens[ki]] == e.before)
        prefetch_line(view_[e.seq].tokens + e.pos);
      ChainIndex::prefetch(index[sc]->older(*h));
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
