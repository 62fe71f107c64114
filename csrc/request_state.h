// Per live request: where its tokens live, its own (request-scope) index and its match state.
#pragma once

#include <cstdint>
#include <vector>

#include "occurrence.h"
#include "request_index.h"
#include "scope_keys.h"

namespace rollout_spec {

struct RequestState {
  int32_t slot = -1;            // its Sequence slot (prompt + output so far)
  RequestIndex own;             // every position of prompt + output: prompt lookup and self-repetition
  // Match state: the occurrences found by the last gather, advanced by every extend (an
  // occurrence survives while its continuation equals the committed tokens). propose reuses
  // them instead of searching the chains again until too few survive or they grow stale.
  std::vector<Occurrence> occ;
  int32_t since_gather = 0;     // tokens committed since the last gather
  bool gathered = false;        // occ is valid (false after start, eviction, end_step)
  uint64_t call = 0;            // last call that named this request (repeated-id check)
  int64_t noise_seed = -1;      // the verifier's noise key of its samples, -1 when not known
  double noise_temperature = 1.0;  // ... and the temperature its tokens are sampled at
};

}  // namespace rollout_spec
