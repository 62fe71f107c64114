// One entry of a hash chain: a stored position whose preceding n-gram has the chain's key.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct ChainRecord {
  int32_t seq;   // sequence slot
  int32_t pos;   // index of the n-gram's last token in that sequence
  int32_t prev;  // older record of the same chain, or -1
};

}  // namespace rollout_spec
