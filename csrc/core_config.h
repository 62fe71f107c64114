// Plain copy of SpecConfig's fields plus the search constants, handed to the core at construction.
// The initializers are the values rollout_spec.drafter sets from SpecConfig() and its constants
// (tests/test_drafter_config_copy.py keeps them equal); it sets every field but
// parallel_min_requests.
#pragma once

#include <cstdint>

namespace rollout_spec {

struct CoreConfig {
  int32_t num_draft_tokens = 8;            // default nodes per request per propose
  int64_t max_batch_draft_tokens = 65536;  // nodes per propose call, over all requests
  int32_t max_depth = 24;                  // longest root-to-leaf path of a draft
  int32_t max_match_len = 32;              // longest backward match measured per occurrence
  int32_t min_match_len = 1;               // occurrences matching fewer tokens are ignored
  double min_token_prob = 0.02;            // path-probability floor when adaptive_budget
  bool tree = true;                        // branching trees (false: one chain)
  bool adaptive_budget = true;             // stop a draft when its path probability is too low
  double scope_weight[3] = {3.0, 1.0, 0.5};// priors of the request, group and global scopes
  int64_t history_steps = 4;               // earlier RL steps kept in a group's scope
  int64_t capacity_tokens = 4000000;       // stored-token bound of finished sequences
  int32_t max_occurrences = 16;            // occurrences gathered per propose: request, group scope
  int32_t global_max_occurrences = 32;     // ... and global scope
  int32_t chain_walk = 16;                 // chain records inspected per key length per scope ...
  int32_t global_unigram_walk = 32;        // ... except the global scope's 1-gram chains
  int32_t enough_occurrences = 8;          // shorter key lengths are tried only below this count
  double evidence_discount = 1.0;          // beta: a node backed by n occurrences keeps n/(n+beta)
  int32_t match_power = 2;                 // occurrence weight grows as match_len ** match_power
  int32_t propose_threads = 0;             // threads per propose call: 0 = min(8, cores / 2), 1 = off
  int32_t parallel_min_requests = 64;      // smaller propose calls stay on the calling thread
};

}  // namespace rollout_spec
