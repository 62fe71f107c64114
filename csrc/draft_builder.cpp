#include "draft_builder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "race_noise.h"

namespace rollout_spec {

namespace {
// Continuation token `d` (0-based) of occurrence o, or -1 past the end of its sequence.
inline int32_t next_token(const Occurrence& o, const std::vector<SlotView>& view, int32_t d) {
  if (d < o.cached) return o.next[d];
  const SlotView& v = view[o.seq];
  return o.pos + 1 + d < v.size ? v.tokens[o.pos + 1 + d] : -1;
}
}  // namespace

DraftBuilder::Expansion DraftBuilder::begin_children(int32_t node, int32_t depth) {
  tail_.clear();
  if (++stamp_ == 0) {  // the stamp wrapped: forget every slot
    for (Slot& s : slots_) s.stamp = 0;
    stamp_ = 1;
  }
  Expansion x;
  x.node = node;
  x.depth = depth;
  x.first_child = static_cast<int32_t>(nodes_.size());
  x.stamp = stamp_;
  x.shift = 32 - slot_bits_;
  x.mask = (1u << slot_bits_) - 1;
  return x;
}

// Inlined into both expansions (a call per member cost about as much as its work). The
// expansion's fields are read from `x`, a local: the int stores below (slots, nodes) may alias
// the builder's members as far as the compiler knows, so those were reloaded for every member.
__attribute__((always_inline)) inline void DraftBuilder::add_member(Expansion& x, int32_t o,
                                                                    int32_t tok) {
  // A member with the same next token as the one before joins its child without the table
  // lookup: runs are common where siblings share a span (at T=0.6 half of the expansions have
  // 5 or more members, and on average 3 children).
  if (tok == x.run_token) {
    join_child(x, x.run_child, o);
    return;
  }
  x.run_token = tok;
  uint32_t h = (static_cast<uint32_t>(tok) * 0x9E3779B1u) >> x.shift;
  while (slots_[h].stamp == x.stamp && slots_[h].token != tok) h = (h + 1) & x.mask;
  Slot& slot = slots_[h];
  if (slot.stamp == x.stamp) {
    x.run_child = slot.child;
    join_child(x, slot.child, o);
    return;
  }
  const int32_t c = static_cast<int32_t>(tail_.size());
  x.run_child = c;
  slot.stamp = x.stamp;
  slot.token = tok;
  slot.child = c;
  tail_.push_back(o);
  // Filled field by field: a braced temporary is copied through the stack in pieces of other
  // sizes than it was written in, which stalls store forwarding on every child.
  TrieNode& n = nodes_.emplace_back();
  n.token = tok;
  n.parent = x.node;
  n.depth = x.depth;
  n.first_occ = o;
  n.weight += weight_[o];  // from +0.0, as join_child adds (a -0.0 weight stays +0.0)
  n.count = 1;
}

__attribute__((always_inline)) inline void DraftBuilder::join_child(const Expansion& x, int32_t c,
                                                                    int32_t o) {
  next_[tail_[c]] = o;
  tail_[c] = o;
  TrieNode& n = nodes_[x.first_child + c];
  n.weight += weight_[o];
  n.count += 1;
}

void DraftBuilder::expand(int32_t node, const std::vector<Occurrence>& occ,
                          const std::vector<SlotView>& view, int32_t max_depth) {
  const TrieNode parent = nodes_[node];  // copy: nodes_ grows below
  if (parent.depth >= max_depth) return;
  // Pass 0: walk the node's member list, noting every member and its next token. Tokens past an
  // occurrence's cached ones are in another sequence's memory; reading them all in a loop of
  // their own lets their misses overlap.
  mem_.resize(parent.count);
  tok_.resize(parent.count);
  for (int32_t j = 0, o = parent.first_occ; j < parent.count; ++j, o = next_[o]) {
    mem_[j] = o;
    tok_[j] = next_token(occ[o], view, parent.depth);
  }
  // Pass 1: the child of every member (children appear in the order of their first member),
  // found through a small open-addressing table from token to child. A scan of the children's
  // tokens costs members x children steps and mispredicts its exit once per member (the number
  // of children changes all the time): at T=1.0 a root has ~30 members and ~17 children, and
  // that scan was a third of the builder's instructions. Slots are stamped per expansion, so
  // the table is never cleared. Each member is linked behind its child's last one, so the
  // child's list is ready without a pass of its own (most children are never expanded).
  Expansion x = begin_children(node, parent.depth + 1);
  for (int32_t j = 0; j < parent.count; ++j) {
    const int32_t tok = tok_[j];
    if (tok >= 0) add_member(x, mem_[j], tok);  // else the occurrence's sequence ends here
  }
  queue_children(parent, x.first_child, max_depth);
}

void DraftBuilder::expand_root(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                               const CoreConfig& cfg, int32_t max_depth) {
  // The root's members are every occurrence, in gather order (at T=0.6 ~29 of a build's ~65
  // member visits): they are weighed and sorted into the root's children in one pass, without
  // the member list and the token pass of other nodes (their first continuation token is
  // nearly always cached in the occurrence).
  const int32_t n_occ = static_cast<int32_t>(occ.size());
  weight_.resize(n_occ);
  next_.resize(n_occ);
  double total = 0.0;
  // Read once: the stores below could alias cfg's fields as far as the compiler knows.
  const int32_t power = cfg.match_power;
  const double scope_weight[3] = {cfg.scope_weight[0], cfg.scope_weight[1], cfg.scope_weight[2]};
  bool plain = true;  // every weight >= 0 (not NaN): see plain_keys_
  Expansion x = begin_children(0, 1);
  for (int32_t i = 0; i < n_occ; ++i) {
    // Longer matches are more predictive: weight = scope prior * match_len ** match_power.
    // The default power 2 is spelled out (the same two products in the same order).
    double w = scope_weight[occ[i].scope];
    const double m = occ[i].match_len;
    if (power == 2) {
      w = w * m * m;
    } else {
      for (int32_t p = 0; p < power; ++p) w *= m;
    }
    weight_[i] = w;
    plain &= w >= 0.0;
    total += w;
    const int32_t tok = next_token(occ[i], view, 0);
    if (tok >= 0) add_member(x, i, tok);
  }
  plain_keys_ = plain && total > 0.0 && total <= std::numeric_limits<double>::max() &&
                cfg.evidence_discount >= 0.0;
  TrieNode& root = nodes_[0];
  root.count = n_occ;
  root.weight = total;
  if (max_depth > 0) queue_children(root, x.first_child, max_depth);
}

void DraftBuilder::queue_children(const TrieNode& parent, int32_t first_child, int32_t max_depth) {
  const int32_t last = static_cast<int32_t>(nodes_.size());
  const size_t was = frontier_.size();
  // Read once: the children's stores below may alias `parent` and floor_ as far as the compiler
  // knows, so they were reloaded for every child.
  const double weight = parent.weight, prob = parent.prob, priority = parent.priority;
  const double min_prob = floor_;
  const bool raced = key_.seed >= 0;
  if (raced) race_ratios(parent, first_child);
  for (int32_t c = first_child; c < last; ++c) {
    TrieNode& n = nodes_[c];
    const double ratio = n.weight / weight;
    // Count ratios overrate continuations seen once or twice; beta discounts thin evidence in
    // the order of expansion (discount_[n] = n / (n + beta)), while the min_token_prob floor
    // judges the plain ratio. A raced child's order follows its chance in the race instead; the
    // floor still judges the evidence (it was tuned on it, and a chance below it can still pay
    // where verification is cheap).
    n.prob = prob * ratio;
    n.priority = raced ? priority * ratio_[c - first_child] : priority * ratio * discount_[n.count];
    // A node below the floor would be popped and dropped with its subtree: never queue it.
    if (n.prob < min_prob || n.priority <= 0.0) continue;
    Entry& e = frontier_.emplace_back();  // ties: the earlier occurrence, then shallower
    e.priority = n.priority;
    e.tie = int64_t(n.first_occ) * (max_depth + 1) + n.depth;
    e.node = c;
  }
  // Every queued sibling above the room left is emitted before the rest of them can be, so only
  // the best `room_` siblings can ever come out (a wide root keeps 8 of dozens).
  if (frontier_.size() - was > static_cast<size_t>(room_)) {
    std::nth_element(frontier_.begin() + was, frontier_.begin() + was + room_, frontier_.end(),
                     [](const Entry& a, const Entry& b) { return b < a; });
    frontier_.resize(was + room_);
  }
  queued(was);
}

// Race-aware ratios, fitted on our own samples of the default model (gsm_symbolic, 64 samples x
// 2 RL steps at T=1.0 and at T=0.6, ~21k root rows each replayed through the drafter with their
// keys; docs/drafter.md, "Race-aware proposals"):
// - the child most likely to win ranks by a log r_c + G_c, a = 1.5 / T^2: at T=1.0 the first
//   node is accepted 0.243 of the time against 0.206 by evidence alone, at T=0.6 0.531 against
//   0.524 (there the evidence nearly decides, and a = 1.5 would lose 2.5%);
// - the evidence ratios r_c overstate the other children's chances: their acceptance is
//   kappa r_c, kappa 0.5 at T=1.0 (half the race is won outside the children, whose ratios sum
//   to ~0.64) and 1.0 at T=0.6;
// - the leader's chance is (1 - lambda) r + lambda pi, pi = exp(-R e^-(log kappa r + G)) the
//   chance it beats the unseen mass R = 1 - kappa sum r (the sharp answer, were kappa r exact),
//   lambda 0.4 at T=1.0 and 0.2 at T=0.6: that blend is calibrated (T=1.0: Brier 0.176 against
//   0.198 for r alone).
// kappa and lambda go linearly from their T=0.6 to their T=1.0 values and stay there outside.
void DraftBuilder::set_race(const RaceKey& key) {
  key_ = key;
  if (key.seed < 0) return;
  const double t = key.temperature, warm = std::clamp((t - 0.6) / 0.4, 0.0, 1.0);
  rank_power_ = static_cast<float>(1.5 / (t * t));
  kappa_ = 1.0 - 0.5 * warm;
  lambda_ = 0.2 + 0.2 * warm;
}

void DraftBuilder::race_ratios(const TrieNode& parent, int32_t first_child) {
  // The verifier draws the parent row's token as the argmax of log p(v) + G_v, with G_v known
  // here (keyed noise), so the children's chances are those of a race, not their evidence alone.
  // Single precision for the ranking: it only orders the children.
  const int32_t n = static_cast<int32_t>(nodes_.size()) - first_child;
  ratio_.resize(n);
  const int64_t position = key_.position + parent.depth;
  double seen = 0.0;
  float best = -std::numeric_limits<float>::infinity(), best_noise = 0.0f;
  int32_t leader = -1;
  for (int32_t c = 0; c < n; ++c) {
    const TrieNode& node = nodes_[first_child + c];
    const double r = node.weight / parent.weight * discount_[node.count];
    ratio_[c] = r;
    seen += r;
    if (r <= 0.0) continue;
    const float u = race_uniform(key_.seed, position, node.token, key_.q, kRaceTag);
    const float noise = -std::log(-std::log1p(-u));  // verify's Gumbel draw of this token
    const float score = rank_power_ * std::log(static_cast<float>(r)) + noise;
    if (score > best) {
      best = score;
      best_noise = noise;
      leader = c;
    }
  }
  if (leader < 0) return;
  const double r = ratio_[leader], unseen = std::max(1.0 - kappa_ * seen, 0.0);
  const double sharp = std::exp(-unseen * std::exp(-(std::log(kappa_ * r) + best_noise)));
  for (int32_t c = 0; c < n; ++c) ratio_[c] *= kappa_;
  ratio_[leader] = (1.0 - lambda_) * r + lambda_ * sharp;
}

void DraftBuilder::queued(size_t was) {
  // Keys are distinct (no two nodes share an occurrence and a depth), so the pop order does not
  // depend on how the frontier is kept: a node's children are heapified at once when it is empty.
  if (scan_) return;
  if (was == 0) {
    std::make_heap(frontier_.begin(), frontier_.end());
  } else {
    for (size_t k = was + 1; k <= frontier_.size(); ++k) std::push_heap(frontier_.begin(), frontier_.begin() + k);
  }
}

DraftBuilder::Entry DraftBuilder::pop_best() {
  if (!scan_) {
    std::pop_heap(frontier_.begin(), frontier_.end());
    const Entry e = frontier_.back();
    frontier_.pop_back();
    return e;
  }
  // The frontier of a small budget holds a few dozen entries at most: one pass picking the best
  // (a select, no data-dependent branch) beats a heap's sift, which mispredicts at every level.
  const size_t best = plain_keys_ ? best_by_key() : best_by_compare();
  const Entry e = frontier_[best];
  frontier_[best] = frontier_.back();
  frontier_.pop_back();
  return e;
}

size_t DraftBuilder::best_by_compare() const {
  size_t best = 0;
  for (size_t k = 1; k < frontier_.size(); ++k) best = frontier_[best] < frontier_[k] ? k : best;
  return best;
}

size_t DraftBuilder::best_by_key() const {
  // Entry's order as one 128-bit integer: the priority's bits (they order +0 and positive
  // doubles as their values do, and are equal exactly when the values are), then ~tie (ties are
  // >= 0, so the smaller tie gives the larger half). The best key stays in registers and the
  // compare is branch-free; Entry's operator< reloads the best entry every step (a dependency
  // through memory per entry) and branches on equal priorities.
  using Key = unsigned __int128;
  const Entry* f = frontier_.data();
  const auto key = [](const Entry& e) {
    uint64_t bits;
    std::memcpy(&bits, &e.priority, sizeof bits);
    return (Key(bits) << 64) | ~static_cast<uint64_t>(e.tie);
  };
  size_t best = 0;
  Key best_key = key(f[0]);
  for (size_t k = 1, n = frontier_.size(); k < n; ++k) {
    const Key k_key = key(f[k]);
    const bool better = k_key > best_key;
    best = better ? k : best;
    best_key = better ? k_key : best_key;
  }
  return best;
}

void DraftBuilder::defer(int32_t node, int32_t max_depth) {
  const TrieNode& n = nodes_[node];
  if (n.depth >= max_depth) return;
  // No child can rank above this entry: a child has at most all of the node's weight and all of
  // its occurrences, and its tie value is at least this one (an occurrence of the child is one of
  // the node's, one level deeper). A raced child's factor is at most (1 - lambda) d + lambda
  // for the leader (its sharp chance is at most 1) and kappa d <= d for the others. The last
  // factor only makes the bound safe against rounding.
  const double d = discount_[n.count];
  Entry& e = frontier_.emplace_back();
  e.priority = n.priority * (key_.seed >= 0 ? (1.0 - lambda_) * d + lambda_ : d) * (1.0 + 1e-9);
  e.tie = int64_t(n.first_occ) * (max_depth + 1) + n.depth + 1;
  e.node = ~node;
  queued(frontier_.size() - 1);
}

void DraftBuilder::build(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                         const CoreConfig& cfg, int32_t budget, DraftOutput& out,
                         const RaceKey& key) {
  int32_t emitted = 0;
  set_race(key);
  if (budget > 0 && !occ.empty()) {
    const int32_t max_depth = std::min(budget, cfg.max_depth);
    const int32_t n_occ = static_cast<int32_t>(occ.size());
    if (discount_beta_ != cfg.evidence_discount || static_cast<int32_t>(discount_.size()) <= n_occ) {
      discount_beta_ = cfg.evidence_discount;
      discount_.resize(std::max<size_t>(discount_.size(), n_occ + 1));
      for (size_t c = 0; c < discount_.size(); ++c)
        discount_[c] = static_cast<double>(c) / (static_cast<double>(c) + discount_beta_);
    }
    if (slot_bits_ == 0 || (int64_t(1) << slot_bits_) < 2 * int64_t(n_occ)) {
      slot_bits_ = 8;
      while ((int64_t(1) << slot_bits_) < 2 * int64_t(n_occ)) ++slot_bits_;
      slots_.assign(size_t(1) << slot_bits_, Slot{});
      stamp_ = 0;
    }
    nodes_.clear();
    TrieNode& root = nodes_.emplace_back();
    root.prob = root.priority = 1.0;
    frontier_.clear();
    scan_ = budget <= kScanBudget;
    floor_ = cfg.adaptive_budget ? cfg.min_token_prob : 0.0;
    room_ = budget;
    expand_root(occ, view, cfg, max_depth);
    while (emitted < budget && !frontier_.empty()) {
      const Entry top = pop_best();
      const double priority = top.priority;
      const int32_t id = top.node;
      if (id < 0) {  // an emitted node's children are due: make them now
        expand(~id, occ, view, max_depth);
        continue;
      }
      TrieNode& n = nodes_[id];
      // Below the floor: skip it and, since probabilities only shrink downwards, its subtree.
      if (n.prob < floor_ || priority <= 0.0) continue;
      n.out_index = emitted++;
      room_ = budget - emitted;
      out.tokens.push_back(n.token);
      out.probs.push_back(static_cast<float>(priority));
      // A node enters the frontier only after its parent was emitted, so out_index is set.
      out.parents.push_back(n.parent == 0 ? -1 : nodes_[n.parent].out_index);
      if (!cfg.tree) frontier_.clear();  // chain: only the chosen node's children stay candidates
      defer(id, max_depth);
    }
  }
  out.offsets.push_back(out.offsets.back() + emitted);
}

}  // namespace rollout_spec
