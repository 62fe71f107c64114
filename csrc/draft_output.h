// The native form of a DraftBatch: CSR arrays appended to request by request.
#pragma once

#include <cstdint>
#include <vector>

namespace rollout_spec {

struct DraftOutput {
  std::vector<int32_t> offsets{0};  // B + 1 entries once B requests are appended
  std::vector<int32_t> tokens;      // draft tokens of all requests, each request's slice topological
  std::vector<int32_t> parents;     // parent index within the request's slice, -1 for the root
  std::vector<float> probs;         // estimated path probability of each node
};

}  // namespace rollout_spec
