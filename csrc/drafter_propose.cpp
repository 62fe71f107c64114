// Proposal path: gather occurrences from the three scopes, then build each request's tree.
#include <algorithm>

#include "drafter_core.h"

namespace rollout_spec {

namespace {
// Tokens equal going backwards from ctx's end and from pos, at most `cap`.
inline int32_t match_back(const std::vector<int32_t>& ctx, const std::vector<int32_t>& seq,
                          int32_t pos, int32_t cap) {
  int32_t m = 0;
  int32_t c = static_cast<int32_t>(ctx.size()) - 1;
  while (m < cap && c - m >= 0 && pos - m >= 0 && ctx[c - m] == seq[pos - m]) ++m;
  return m;
}
}  // namespace

template <class Accept>
void DrafterCore::gather_scope(const ChainIndex& index, int scope, const std::vector<int32_t>& ctx,
                               Accept accept, std::vector<Occurrence>& occ) const {
  const size_t first = occ.size();
  const int32_t len = static_cast<int32_t>(ctx.size());
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const int32_t k = kKeyLens[ki];
    const size_t have = occ.size() - first;
    if (have >= static_cast<size_t>(cfg_.enough_occurrences)) break;
    if (k > len) continue;
    const int32_t need = std::max(std::min(k, cfg_.max_match_len), cfg_.min_match_len);
    int32_t r = index.head(ki, ngram_key(ctx.data(), len - 1, k));
    for (int32_t walked = 0; r >= 0 && walked < cfg_.chain_walk; ++walked) {
      const ChainRecord& rec = index.record(ki, r);
      r = rec.prev;
      // Chains are linked lists scattered over the record array: fetch the next link early.
      if (r >= 0) __builtin_prefetch(&index.record(ki, r));
      // Positions already taken through a longer key come back in the shorter keys' chains;
      // rejecting them first spares two cache misses (the sequence and its tokens).
      bool dup = false;
      for (size_t j = first; j < occ.size() && !dup; ++j)
        dup = occ[j].seq == rec.seq && occ[j].pos == rec.pos;
      if (dup) continue;
      const std::vector<int32_t>& toks = seqs_[rec.seq].tokens;
      if (rec.pos + 1 >= static_cast<int32_t>(toks.size()) || !accept(rec.seq)) continue;
      int32_t m = match_back(ctx, toks, rec.pos, cfg_.max_match_len);
      if (m < need) continue;  // hash collision, or shorter than min_match_len
      occ.push_back(Occurrence{rec.seq, rec.pos, m, scope});
      if (occ.size() - first >= static_cast<size_t>(cfg_.max_occurrences)) break;
    }
  }
}

void DrafterCore::gather(const RequestState& req, std::vector<Occurrence>& occ) const {
  occ.clear();
  const int32_t own = req.slot;
  const std::vector<int32_t>& ctx = seqs_[own].tokens;
  if (ctx.empty()) return;
  const int32_t group = seqs_[own].group;
  const bool use_group = group >= 0 && cfg_.scope_weight[1] > 0.0;
  if (cfg_.scope_weight[0] > 0.0)
    gather_scope(req.own, 0, ctx, [](int32_t) { return true; }, occ);
  if (use_group) {
    auto it = groups_.find(group);
    if (it != groups_.end())
      gather_scope(it->second, 1, ctx,
                   [&](int32_t seq) { return in_group_scope(seq, own, group); }, occ);
  }
  if (cfg_.scope_weight[2] > 0.0)
    gather_scope(global_, 2, ctx,
                 [&](int32_t seq) {
                   return seq != own && !(use_group && in_group_scope(seq, own, group));
                 },
                 occ);
}

void DrafterCore::propose(const int64_t* ids, const int32_t* budgets, size_t n, DraftOutput& out) {
  std::lock_guard<std::mutex> lock(mu_);
  check_ids(ids, n, /*must_exist=*/true);
  out = DraftOutput{};
  out.offsets.reserve(n + 1);
  int64_t left = cfg_.max_batch_draft_tokens;
  for (size_t i = 0; i < n; ++i) {
    int64_t want = budgets ? budgets[i] : cfg_.num_draft_tokens;
    int32_t budget = static_cast<int32_t>(std::min<int64_t>(want, left));
    const RequestState& req = requests_.find(ids[i])->second;
    if (budget > 0) gather(req, occ_);
    else occ_.clear();
    builder_.build(occ_, seqs_, cfg_, budget, out);
    left -= out.offsets.back() - out.offsets[out.offsets.size() - 2];
  }
}

}  // namespace rollout_spec
