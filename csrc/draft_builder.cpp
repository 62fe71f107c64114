#include "draft_builder.h"

#include <algorithm>

namespace rollout_spec {

int32_t DraftBuilder::child(int32_t parent, int32_t token) {
  for (int32_t c = nodes_[parent].first_child; c >= 0; c = nodes_[c].next_sibling)
    if (nodes_[c].token == token) return c;
  int32_t id = static_cast<int32_t>(nodes_.size());
  nodes_.push_back(TrieNode{token, parent, -1, -1, -1, -1, 0.0, 0, 0.0, 0.0});
  TrieNode& p = nodes_[parent];
  if (p.last_child >= 0) nodes_[p.last_child].next_sibling = id;
  else p.first_child = id;
  p.last_child = id;
  return id;
}

void DraftBuilder::grow_trie(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                             const CoreConfig& cfg, int32_t depth) {
  nodes_.clear();
  nodes_.push_back(TrieNode{-1, -1, -1, -1, -1, -1, 0.0, 0, 1.0, 1.0});
  for (const Occurrence& o : occ) {
    // Longer matches are more predictive: weight = scope prior * match_len ** match_power.
    double w = cfg.scope_weight[o.scope];
    for (int32_t i = 0; i < cfg.match_power; ++i) w *= o.match_len;
    const SlotView& v = view[o.seq];
    const int32_t end = std::min(v.size, o.pos + 1 + depth);
    nodes_[0].weight += w;
    int32_t cur = 0;
    for (int32_t i = o.pos + 1; i < end; ++i) {
      cur = child(cur, v.tokens[i]);
      nodes_[cur].weight += w;
      nodes_[cur].count += 1;
    }
  }
}

void DraftBuilder::push_children(int32_t node, double beta) {
  const TrieNode& p = nodes_[node];
  for (int32_t c = p.first_child; c >= 0; c = nodes_[c].next_sibling) {
    double ratio = nodes_[c].weight / p.weight;
    // Count ratios overrate continuations seen once or twice; beta discounts thin evidence in
    // the order of expansion, while the min_token_prob floor judges the plain ratio.
    double n = nodes_[c].count;
    nodes_[c].prob = p.prob * ratio;
    nodes_[c].priority = p.priority * ratio * (n / (n + beta));
    heap_.emplace_back(nodes_[c].priority, -c);  // ties: the older node (smaller id) wins
    std::push_heap(heap_.begin(), heap_.end());
  }
}

void DraftBuilder::build(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                         const CoreConfig& cfg, int32_t budget, DraftOutput& out) {
  int32_t emitted = 0;
  if (budget > 0 && !occ.empty()) {
    grow_trie(occ, view, cfg, std::min(budget, cfg.max_depth));
    double floor = cfg.adaptive_budget ? cfg.min_token_prob : 0.0;
    heap_.clear();
    push_children(0, cfg.evidence_discount);
    while (emitted < budget && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end());
      auto [priority, neg_id] = heap_.back();
      heap_.pop_back();
      TrieNode& n = nodes_[-neg_id];
      // Below the floor: skip it and, since probabilities only shrink downwards, its subtree.
      if (n.prob < floor || priority <= 0.0) continue;
      n.out_index = emitted++;
      out.tokens.push_back(n.token);
      out.probs.push_back(static_cast<float>(priority));
      // A node enters the frontier only after its parent was emitted, so out_index is set.
      out.parents.push_back(n.parent == 0 ? -1 : nodes_[n.parent].out_index);
      if (!cfg.tree) heap_.clear();  // chain: only the chosen node's children stay candidates
      push_children(-neg_id, cfg.evidence_discount);
    }
  }
  out.offsets.push_back(out.offsets.back() + emitted);
}

}  // namespace rollout_spec
