// A place in the stored corpus whose preceding tokens match the end of a request's context.
#pragma once

#include <cstdint>

namespace rollout_spec {

constexpr int32_t kCachedNext = 3;  // continuation tokens copied into an occurrence

struct Occurrence {
  int32_t seq = 0;        // sequence slot
  int32_t pos = 0;        // index of the last matched token; the continuation starts at pos + 1
  int32_t match_len = 0;  // matched tokens, counted backwards from pos, capped at max_match_len
  int32_t scope = 0;      // 0 request, 1 group, 2 global: selects the weight prior
  // The first `cached` continuation tokens (stored tokens never change), copied by the search
  // (a chain record holds the first; a longer match's line is loaded anyway), so that the tree
  // reads them without touching the sequence.
  int32_t cached = 0;
  int32_t next[kCachedNext] = {};
};

}  // namespace rollout_spec
