// Counters reported by DrafterCore::stats (sizes per scope, memory, RL step).
#pragma once

#include <cstdint>

namespace rollout_spec {

struct CoreStats {
  int64_t num_requests = 0;     // live requests
  int64_t num_sequences = 0;    // stored sequences (live, finished, ingested, corpora)
  int64_t index_tokens = 0;     // tokens stored in those sequences (what capacity bounds)
  int64_t memory_bytes = 0;     // bytes held by sequences, indexes and request states
  int64_t step = 0;             // RL steps ended so far
  int64_t num_groups = 0;       // groups with a non-empty group index
  int64_t request_records = 0;  // chain records over all request-scope indexes
  int64_t group_records = 0;    // chain records over all group indexes
  int64_t global_records = 0;   // chain records of the global index
  int64_t evictions = 0;        // sequences evicted so far
  int64_t proposals = 0;        // request proposals made (budget > 0)
  int64_t ahead_hits = 0;       // propose calls served by a proposal drafted ahead
  int64_t ahead_dropped = 0;    // proposals drafted ahead and never used
};

}  // namespace rollout_spec
