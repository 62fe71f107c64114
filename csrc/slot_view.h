// The few fields of a stored sequence that the proposal path reads for every chain record, kept
// in one small dense array (16 bytes per slot) so that filtering a record costs no cache miss on
// the Sequence itself.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct SlotView {
  const int32_t* tokens = nullptr;  // the sequence's tokens; refreshed after every append
  int32_t size = 0;                 // number of tokens
  int32_t scope_group = -1;         // its group id while it belongs to that group's scope, else -1
};

}  // namespace rollout_spec
