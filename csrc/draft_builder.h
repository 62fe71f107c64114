// Turns one request's occurrences into a draft tree: a weighted continuation trie, expanded
// best first by estimated path probability until the budget or the probability floor is hit.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core_config.h"
#include "draft_output.h"
#include "occurrence.h"
#include "slot_view.h"
#include "trie_node.h"

namespace rollout_spec {

class DraftBuilder {
 public:
  // Append the request's tree (at most `budget` nodes) to `out`, including its offsets entry.
  void build(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
             const CoreConfig& cfg, int32_t budget, DraftOutput& out);

 private:
  void grow_trie(const std::vector<Occurrence>& occ, const std::vector<SlotView>& view,
                 const CoreConfig& cfg, int32_t depth);
  int32_t child(int32_t parent, int32_t token);
  void push_children(int32_t node, double beta);

  std::vector<TrieNode> nodes_;                    // scratch trie; nodes_[0] is the root
  std::vector<std::pair<double, int32_t>> heap_;   // frontier: (path prob, -node id), max-heap
};

}  // namespace rollout_spec
