// Per live request: where its tokens live, its own (request-scope) index and its noise key.
#pragma once

#include <cstdint>

#include "request_index.h"
#include "scope_keys.h"

namespace rollout_spec {

struct RequestState {
  int32_t slot = -1;            // its Sequence slot (prompt + output so far)
  RequestIndex own;             // every position of prompt + output: prompt lookup and self-repetition
  uint64_t call = 0;            // last call that named this request (repeated-id check)
  int64_t noise_seed = -1;      // the verifier's noise key of its samples, -1 when not known
  double noise_temperature = 1.0;  // ... and the temperature its tokens are sampled at
};

}  // namespace rollout_spec
