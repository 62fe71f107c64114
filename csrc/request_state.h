// Per live request: where its tokens live, its own (request-scope) index and its match state.
#pragma once

#include <cstdint>
#include <vector>

#include "chain_index.h"
#include "occurrence.h"

namespace rollout_spec {

// Key lengths of a request's own index: 4 and 1 (bits of kAllKeys). A 1-gram record's match
// is measured backwards, so within one request's text the 2-gram chain found nothing the
// 1-gram chain did not (shared traces: TPF equal to the third decimal without it), while it
// cost a third of the request scope's inserts (prompts included). The 4-gram chain stays: it
// reaches a copied span anywhere in a long prompt, where the last token's 16 newest records
// do not (a code-edit trace lost 18% TPF with the 1-gram key alone).
constexpr uint32_t kRequestKeys = 0b101u;

struct RequestState {
  int32_t slot = -1;            // its Sequence slot (prompt + output so far)
  ChainIndex own;               // every position of prompt + output: prompt lookup and self-repetition
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
