#include "draft_builder.h"

#include <algorithm>

namespace rollout_spec {

namespace {
// Continuation token `d` (0-based) of occurrence o, or -1 past the end of its sequence.
inline int32_t next_token(const Occurrence& o, const std::vector<SlotView>& view, int32_t d) {
  if (d < o.cached) return o.next[d];
  const SlotView& v = view[o.seq];
  return o.pos + 1 + d < v.size ? v.tokens[o.pos + 1 + d] : -1;
}
}  // namespace

void DraftBuilder::expand(int32_t node, const std::vector<Occurrence>& occ,
                          const std::vector<SlotView>& view, int32_t max_depth, double beta) {
  const TrieNode parent = nodes_[node];  // copy: nodes_ grows below
  if (parent.depth >= max_depth) return;
  const int32_t first_child = static_cast<int32_t>(nodes_.size());
  // Pass 1: the child of every member (children appear in the order of their first member).
  scratch_.assign(parent.count, -1);
  for (int32_t j = 0; j < parent.count; ++j) {
    const int32_t i = members_[parent.members + j];
    const int32_t tok = next_token(occ[i], view, parent.depth);
    if (tok < 0) continue;
    int32_t c = first_child;
    while (c < static_cast<int32_t>(nodes_.size()) && nodes_[c].token != tok) ++c;
    if (c == static_cast<int32_t>(nodes_.size()))
      nodes_.push_back(TrieNode{tok, node, parent.depth + 1, i, 0, 0, -1, 0.0, 0.0, 0.0});
    nodes_[c].weight += weight_[i];
    nodes_[c].count += 1;
    scratch_[j] = c;
  }
  // Pass 2: lay out each child's members contiguously (a counting sort, keeping their order).
  const int32_t last = static_cast<int32_t>(nodes_.size());
  int32_t at = static_cast<int32_t>(members_.size());
  for (int32_t c = first_child; c < last; ++c) {
    nodes_[c].members = at;
    at += nodes_[c].count;
  }
  members_.resize(at);
  fill_.assign(last - first_child, 0);
  for (int32_t j = 0; j < parent.count; ++j) {
    const int32_t c = scratch_[j];
    if (c >= 0) members_[nodes_[c].members + fill_[c - first_child]++] = members_[parent.members + j];
  }
  for (int32_t c = first_child; c < last; ++c) {
    TrieNode& n = nodes_[c];
    const double ratio = n.weight / parent.weight;
    // Count ratios overrate continuations seen once or twice; beta discounts thin evidence in
    // the order of expansion, while the min_token_prob floor judges the plain ratio.
    n.prob = parent.prob * ratio;
    n.priority = parent.priority * ratio * (n.count / (n.count + beta));
    const int64_t tie = int64_t(n.first_occ) * (max_depth + 1) + n.depth;
    heap_.push_back(Entry{n.priority, tie, c});  // ties: the earlier occurrence, then shallower
    std::push_heap(heap_.begin(), heap_.end());
  }
}

void DraftBuilder::build(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                         const CoreConfig& cfg, int32_t budget, DraftOutput& out) {
  int32_t emitted = 0;
  if (budget > 0 && !occ.empty()) {
    const int32_t max_depth = std::min(budget, cfg.max_depth);
    const int32_t n_occ = static_cast<int32_t>(occ.size());
    weight_.resize(n_occ);
    members_.resize(n_occ);
    double total = 0.0;
    for (int32_t i = 0; i < n_occ; ++i) {
      // Longer matches are more predictive: weight = scope prior * match_len ** match_power.
      double w = cfg.scope_weight[occ[i].scope];
      for (int32_t p = 0; p < cfg.match_power; ++p) w *= occ[i].match_len;
      weight_[i] = w;
      members_[i] = i;
      total += w;
    }
    nodes_.clear();
    nodes_.push_back(TrieNode{-1, -1, 0, 0, 0, n_occ, -1, total, 1.0, 1.0});
    heap_.clear();
    const double floor = cfg.adaptive_budget ? cfg.min_token_prob : 0.0;
    expand(0, occ, view, max_depth, cfg.evidence_discount);
    while (emitted < budget && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end());
      const double priority = heap_.back().priority;
      const int32_t id = heap_.back().node;
      heap_.pop_back();
      TrieNode& n = nodes_[id];
      // Below the floor: skip it and, since probabilities only shrink downwards, its subtree.
      if (n.prob < floor || priority <= 0.0) continue;
      n.out_index = emitted++;
      out.tokens.push_back(n.token);
      out.probs.push_back(static_cast<float>(priority));
      // A node enters the frontier only after its parent was emitted, so out_index is set.
      out.parents.push_back(n.parent == 0 ? -1 : nodes_[n.parent].out_index);
      if (!cfg.tree) heap_.clear();  // chain: only the chosen node's children stay candidates
      expand(id, occ, view, max_depth, cfg.evidence_discount);
    }
  }
  out.offsets.push_back(out.offsets.back() + emitted);
}

}  // namespace rollout_spec
