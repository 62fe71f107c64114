// One entry of a chain index's insertion log: a stored position that was indexed, in the order it
// was indexed. One entry serves every key length (the position is in the chain of each key
// length k with k <= pos + 1), so the log grows by one entry per indexed position.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct ChainRecord {
  int32_t seq;  // sequence slot
  int32_t pos;  // index of the n-gram's last token in that sequence; pos + 1 always exists
};

}  // namespace rollout_spec
