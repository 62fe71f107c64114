// One stored token sequence: a live request's prompt + output, a finished response, or a corpus.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "huge_pages.h"

namespace rollout_spec {

struct Sequence {
  std::vector<int32_t, HugePageAllocator<int32_t>> tokens;  // prompt (if any) followed by the response tokens
  int64_t req_id = -1;          // the live request writing it, -1 once finished or when ingested
  int32_t group = -1;           // group_id shared by a prompt's samples; -1 means none
  int32_t prompt_len = 0;       // leading tokens indexed only in the request scope
  int64_t step = 0;             // RL step of the last write; eviction goes oldest step first
  uint64_t order = 0;           // creation counter; breaks eviction ties oldest first
  bool live = false;            // a request is still extending it (never evicted)
  bool alive = false;           // slot in use; false once evicted or never used
  bool pinned = false;          // external corpus: never evicted, never aged

  // Positions with a next token: an index holds a position only once its continuation exists.
  int32_t positions_with_next() const { return std::max(static_cast<int32_t>(tokens.size()) - 1, 0); }
};

}  // namespace rollout_spec
