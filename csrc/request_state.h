// Per live request: where its tokens live and its own (request-scope) index.
#pragma once

#include <cstdint>

#include "chain_index.h"

namespace rollout_spec {

struct RequestState {
  int32_t slot = -1;  // its Sequence slot (prompt + output so far)
  ChainIndex own;     // every position of prompt + output: prompt lookup and self-repetition
};

}  // namespace rollout_spec
