// A node of the continuation trie that DraftBuilder grows lazily from one request's occurrences.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct TrieNode {
  int32_t token = -1;     // token on the edge into this node (unused for the root)
  int32_t parent = -1;    // parent node id, -1 for the root
  int32_t depth = 0;      // edges from the root
  // First occurrence (in gather order) passing through: the tie-break, and the head of the
  // builder's list of the node's occurrences until it is expanded.
  int32_t first_occ = 0;
  int32_t count = 0;      // occurrences passing through this node
  int32_t out_index = -1; // index in the request's draft slice once emitted, -1 before
  double weight = 0.0;    // summed occurrence weights passing through this node
  double prob = 0.0;      // path probability: product of weight ratios from the root
  double priority = 0.0;  // prob with every step discounted for thin evidence: the heap order
};

}  // namespace rollout_spec
