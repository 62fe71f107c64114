// What one padded tree-verify forward needs from a DraftBatch (the Python TreeInputs' fields),
// built on the host as flat row-major buffers. Column 0 of request b is its root, column 1 + j
// node j of its slice, later columns padding; verify rows go request by request (root, then its
// nodes in slice order), so request b's root is row offsets[b] + b.
//
// Nodes are topologically ordered, so one pass per request suffices: a node's mask row is its
// parent's row plus itself, its depth its parent's plus one. This replaced a numpy build whose
// ancestor mask took one Python-level step per column (~0.17 ms a step at B = 8, W = 33).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rollout_spec {

// Caller-owned outputs of fill_tree_inputs for B requests, N nodes and width W; every cell is
// written, so the buffers need no initialisation.
struct TreeInputsBuffers {
  int64_t* input_ids;   // [B, W]: root token, then the node tokens; padding 0
  int64_t* positions;   // [B, W]: root position + depth (padding: the root position)
  int64_t* depth;       // [B, W]: edges from the root; 0 for the root and padding
  int64_t* parent_col;  // [B, W]: column of the parent; -1 for the root and padding
  int64_t* row_index;   // [B, W]: verify row of the cell; padding: its root's row
  int64_t* flat_index;  // [B + N]: flattened cell b * W + c of each verify row, in row order
  bool* valid;          // [B, W]: the root and real nodes
  bool* tree_mask;      // [B, W, W]: row i sees column j iff j is i, an ancestor of i or the
                        // root (padding rows see the root only)
};

// Throw std::invalid_argument naming the field unless `offsets` (num_requests + 1 entries) start
// at 0, never decrease and end at num_nodes; each parents[i] is -1 or an earlier index of its
// request's slice; and width is at least 1 + the largest tree, with B * W * W cells addressable.
void check_tree_inputs(const int32_t* offsets, size_t num_requests, const int32_t* parents,
                       size_t num_nodes, size_t width);

// Fill every cell of `out` from a batch and width that check_tree_inputs accepted, and the
// requests' root tokens and root positions (num_requests entries each).
void fill_tree_inputs(const int32_t* offsets, size_t num_requests, const int32_t* tokens,
                      const int32_t* parents, const int64_t* root_tokens,
                      const int64_t* root_positions, size_t width, const TreeInputsBuffers& out);

}  // namespace rollout_spec
