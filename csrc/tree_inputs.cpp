#include "tree_inputs.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace rollout_spec {

namespace {

// Request b's cells of the buffers: its row of every [B, W] field and its [W, W] mask block.
struct RequestCells {
  int64_t* ids;
  int64_t* pos;
  int64_t* depth;
  int64_t* parent_col;
  int64_t* row;
  bool* valid;
  bool* mask;
};

RequestCells request_cells(const TreeInputsBuffers& out, size_t b, size_t width) {
  const size_t at = b * width;
  return {out.input_ids + at, out.positions + at, out.depth + at, out.parent_col + at,
          out.row_index + at, out.valid + at, out.tree_mask + at * width};
}

// One request: its root in column 0, its `size` nodes (tokens/parents of its slice) in columns
// 1..size, padding after; `row0` is its root's verify row.
void fill_request(const RequestCells& r, const int32_t* tokens, const int32_t* parents,
                  size_t size, int64_t root_token, int64_t root_position, int64_t row0,
                  size_t width) {
  std::memset(r.mask, 0, width * width);
  r.ids[0] = root_token;
  r.pos[0] = root_position;
  r.depth[0] = 0;
  r.parent_col[0] = -1;
  r.row[0] = row0;
  r.valid[0] = true;
  r.mask[0] = true;
  for (size_t c = 1; c <= size; ++c) {
    const size_t p = static_cast<size_t>(parents[c - 1] + 1);  // < c: topological order
    r.ids[c] = tokens[c - 1];
    r.depth[c] = r.depth[p] + 1;
    r.pos[c] = root_position + r.depth[c];
    r.parent_col[c] = static_cast<int64_t>(p);
    r.row[c] = row0 + static_cast<int64_t>(c);
    r.valid[c] = true;
    bool* row = r.mask + c * width;
    std::memcpy(row, r.mask + p * width, c);  // the parent's row has no column >= c set
    row[c] = true;
  }
  for (size_t c = size + 1; c < width; ++c) {
    r.ids[c] = 0;
    r.pos[c] = root_position;
    r.depth[c] = 0;
    r.parent_col[c] = -1;
    r.row[c] = row0;
    r.valid[c] = false;
    r.mask[c * width] = true;
  }
}

}  // namespace

void check_tree_inputs(const int32_t* offsets, size_t num_requests, const int32_t* parents,
                       size_t num_nodes, size_t width) {
  if (offsets[0] != 0) throw std::invalid_argument("DraftBatch.offsets must start with 0");
  size_t largest = 0;
  for (size_t b = 0; b < num_requests; ++b) {
    if (offsets[b + 1] < offsets[b])
      throw std::invalid_argument("DraftBatch.offsets must be non-decreasing");
    largest = std::max(largest, static_cast<size_t>(offsets[b + 1] - offsets[b]));
  }
  if (static_cast<size_t>(offsets[num_requests]) != num_nodes)
    throw std::invalid_argument("DraftBatch.tokens has " + std::to_string(num_nodes) +
                                " entries, offsets say " + std::to_string(offsets[num_requests]));
  for (size_t b = 0; b < num_requests; ++b)
    for (int32_t i = offsets[b], local = 0; i < offsets[b + 1]; ++i, ++local)
      if (parents[i] < -1 || parents[i] >= local)
        throw std::invalid_argument(
            "DraftBatch.parents[i] must be -1 or in [0, i) within its request's slice "
            "(topological order)");
  if (width < largest + 1)
    throw std::invalid_argument("width must be >= 1 + largest tree = " +
                                std::to_string(largest + 1) + ", got " + std::to_string(width));
  const size_t cells = std::numeric_limits<size_t>::max() / 8;  // keeps int64 [B, W] bytes too
  if (width > cells / width || (num_requests && width * width > cells / num_requests))
    throw std::invalid_argument("width " + std::to_string(width) + " makes the [B, W, W] mask of " +
                                std::to_string(num_requests) + " requests too large");
}

void fill_tree_inputs(const int32_t* offsets, size_t num_requests, const int32_t* tokens,
                      const int32_t* parents, const int64_t* root_tokens,
                      const int64_t* root_positions, size_t width, const TreeInputsBuffers& out) {
  int64_t* flat = out.flat_index;
  for (size_t b = 0; b < num_requests; ++b) {
    const int32_t lo = offsets[b];
    const size_t size = static_cast<size_t>(offsets[b + 1] - lo);
    fill_request(request_cells(out, b, width), tokens + lo, parents + lo, size, root_tokens[b],
                 root_positions[b], static_cast<int64_t>(lo) + static_cast<int64_t>(b), width);
    for (size_t c = 0; c <= size; ++c) *flat++ = static_cast<int64_t>(b * width + c);
  }
}

}  // namespace rollout_spec
