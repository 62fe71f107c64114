// Turns one request's occurrences into a draft tree: a weighted continuation trie, expanded
// best first by estimated path probability until the budget or the probability floor is hit.
//
// The trie is grown lazily: a node's children are made only when the node is emitted, from the
// occurrences passing through it, so the work follows the (small) emitted tree rather than
// every occurrence's full continuation. Ties in priority go to the node first reached by the
// earlier occurrence, then the shallower one: the order in which an eager build, occurrence by
// occurrence, would have created them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core_config.h"
#include "draft_output.h"
#include "occurrence.h"
#include "slot_view.h"
#include "trie_node.h"

namespace rollout_spec {

// The verifier's noise for one request's draft (rollout_spec/noise.py): the row at the draft's
// root races at `position` (a node at depth d at position + d) under key `seed`, at sampling
// `temperature` (> 0); q is the column layout's quarter block. seed < 0: the request's noise is
// not known (greedy, or not told).
struct RaceKey {
  int64_t seed = -1;
  int64_t position = 0;
  uint32_t q = 0;
  double temperature = 1.0;
};

class DraftBuilder {
 public:
  // Append the request's tree (at most `budget` nodes) to `out`, including its offsets entry.
  // With a key, siblings are ranked by what they would score in the verifier's race (below).
  void build(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
             const CoreConfig& cfg, int32_t budget, DraftOutput& out, const RaceKey& key = {});

 private:
  // Make `node`'s children from its member occurrences and queue them on the frontier.
  void expand(int32_t node, const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
              int32_t max_depth);

  // Put an emitted node's children off: one frontier entry whose priority bounds theirs stands for
  // all of them, and they are made only if it is popped (a wide tree of 8 nodes expands few of
  // its leaves). The order of emission is exactly that of expanding at once.
  void defer(int32_t node, int32_t max_depth);

  // The root's expansion: set weight_ (and plain_keys_) for the occurrences, the root's weight
  // to their total, and make and queue its children (every occurrence is a member of the root).
  void expand_root(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                   const CoreConfig& cfg, int32_t max_depth);

  // One expansion in progress: the node whose members are sorted into children, and what
  // sorting a member reads (kept in a local, out of the builder's aliased fields).
  struct Expansion {
    int32_t node = 0;         // the node expanded
    int32_t depth = 0;        // its children's depth
    int32_t first_child = 0;  // its children are nodes_[first_child..]
    uint32_t stamp = 0;       // the table slots of this expansion
    int shift = 0;            // 32 - slot_bits_: a token's hash to its home slot
    uint32_t mask = 0;        // the table's size - 1
    int32_t run_token = -1;   // the last member's next token, and the child it went to
    int32_t run_child = 0;
  };
  // Start expanding `node` (its children at `depth`): forget the last expansion's children.
  Expansion begin_children(int32_t node, int32_t depth);
  // Put occurrence `o`, whose next token is `tok`, into the child for that token, making the
  // child if it is new.
  void add_member(Expansion& x, int32_t o, int32_t tok);
  // Put occurrence `o` into the expansion's child number `c`.
  void join_child(const Expansion& x, int32_t c, int32_t o);

  // Queue the children nodes_[first_child..] just made from `parent` (the best room_ of them).
  void queue_children(const TrieNode& parent, int32_t first_child, int32_t max_depth);

  // With a race key: set ratio_ to the children's chances of winning the verifier's race at
  // the parent's row, whose noise is known, in place of their evidence ratios.
  void race_ratios(const TrieNode& parent, int32_t first_child);
  // The current build's race key and the constants race_ratios takes from its temperature.
  void set_race(const RaceKey& key);
  std::vector<double> ratio_;       // per child of the node being expanded: its factor
  RaceKey key_;
  float rank_power_ = 1.5f;
  double kappa_ = 1.0, lambda_ = 0.0;

  std::vector<TrieNode> nodes_;   // scratch trie; nodes_[0] is the root
  std::vector<double> weight_;    // per occurrence: scope prior * match_len ** match_power
  // Per occurrence: the next member (in gather order) of the same unexpanded node. A node's
  // members (but the root's, which are all occurrences in order) are the list from its
  // first_occ, count long; expanding it relinks them into its children's lists. Unexpanded
  // nodes share no occurrence, so one array holds all their lists, and a child's list is made
  // in the pass that finds its members, with no pass of its own.
  std::vector<int32_t> next_;
  std::vector<int32_t> mem_;      // per member of the node being expanded: its occurrence
  std::vector<int32_t> tail_;     // per child of that node: its last member so far
  double floor_ = 0.0;              // path-probability floor of the current build
  int32_t room_ = 0;                // nodes the current build may still emit
  std::vector<double> discount_;   // n / (n + beta) for n occurrences behind a node
  double discount_beta_ = -1.0;     // the beta discount_ was made for
  std::vector<int32_t> tok_;        // per member of the node being expanded: its next token
  struct Entry {
    double priority;
    int64_t tie;  // smaller wins among equal priorities
    int32_t node;  // ~node for a deferred node's children
    bool operator<(const Entry& o) const {
      return priority != o.priority ? priority < o.priority : tie > o.tie;
    }
  };
  // Frontier by (priority, -tie). With a budget of at most kScanBudget nodes it stays small (at
  // most budget + 1 expansions queue at most budget children each, plus one deferred entry per
  // emitted node), so it is kept unordered and searched in one pass per pop; larger budgets keep
  // it a max-heap.
  std::vector<Entry> frontier_;
  static constexpr int32_t kScanBudget = 16;
  bool scan_ = true;  // the current build keeps frontier_ unordered (else a heap)
  // Entries frontier_[was..] were just appended: restore the heap order if one is kept.
  void queued(size_t was);
  // Remove and return the frontier's best entry.
  Entry pop_best();
  // Index of the unordered frontier's best entry: by Entry's operator<, or, when plain_keys_,
  // by the same order read as one integer per entry (cheaper).
  size_t best_by_compare() const;
  size_t best_by_key() const;
  // The current build's queued priorities are all +0 or positive, never NaN, so that their bits
  // order them as their values do: so it is when every weight is >= 0, their total finite and
  // > 0, and the evidence discount >= 0 (a zero-weight child gets priority 0 and is not queued;
  // no 0/0, 0*inf or negative factor can arise).
  bool plain_keys_ = false;
  // Token -> child of the node being expanded (linear probing), kept at most half full: a node
  // has at most as many children as the proposal has occurrences, and build sizes it for those.
  struct Slot {
    uint32_t stamp = 0;  // the expansion that filled it; any other stamp means empty
    int32_t token = 0;   // the child's token
    int32_t child = 0;   // child number, in the order of first member
  };
  int slot_bits_ = 0;        // the table has 2^slot_bits_ slots
  std::vector<Slot> slots_;
  uint32_t stamp_ = 0;       // the current expansion's stamp
};

}  // namespace rollout_spec
