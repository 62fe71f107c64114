// A node of the continuation trie that DraftBuilder grows lazily from one request's occurrences.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct TrieNode {
  int32_t token;         // token on the edge into this node (unused for the root)
  int32_t parent;        // parent node id, -1 for the root
  int32_t depth;         // edges from the root
  int32_t first_occ;     // first occurrence (in gather order) passing through: the tie-break
  int32_t members;       // its occurrences are members_[members, members + count)
  int32_t count;         // occurrences passing through this node
  int32_t out_index;     // index in the request's draft slice once emitted, -1 before
  double weight;         // summed occurrence weights passing through this node
  double prob;           // path probability: product of weight ratios from the root
  double priority;       // prob with every step discounted for thin evidence: the heap order
};

}  // namespace rollout_spec
