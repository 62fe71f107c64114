// The drafter: stored sequences, the request / group / global chain indexes, and proposals.
//
// Every public method takes the instance mutex, so one thread may extend while another
// proposes; bindings release the GIL around these calls. Batch inputs come as CSR arrays
// (ids[n], tokens[...], offsets[n+1]); all checks run before any state changes.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "chain_index.h"
#include "core_config.h"
#include "core_stats.h"
#include "draft_builder.h"
#include "draft_output.h"
#include "occurrence.h"
#include "request_state.h"
#include "sequence.h"

namespace rollout_spec {

class DrafterCore {
 public:
  explicit DrafterCore(const CoreConfig& cfg);

  void start(const int64_t* ids, const int32_t* groups, const int32_t* tokens,
             const int64_t* offsets, size_t n);
  void extend(const int64_t* ids, const int32_t* tokens, const int64_t* offsets, size_t n);
  void finish(const int64_t* ids, size_t n);
  // budgets may be null (each request gets num_draft_tokens).
  void propose(const int64_t* ids, const int32_t* budgets, size_t n, DraftOutput& out);
  // Finished sequences produced elsewhere; pinned ones (external corpora) are never evicted.
  void add_sequences(const int32_t* groups, const int32_t* tokens, const int64_t* offsets,
                     size_t n, bool pinned);
  void end_step();

  CoreStats stats() const;
  bool has_request(int64_t id) const;
  // Empty string when every invariant holds, else a description of the first violation.
  std::string check_integrity() const;

  void save(std::ostream& os, const std::string& meta) const;
  // Replace this instance's state with a saved one; returns the saved meta string.
  std::string load(std::istream& is);

 private:
  int32_t new_slot();
  void index_position(int32_t slot, RequestState* req, int32_t pos);
  void gather(const RequestState& req, std::vector<Occurrence>& occ) const;
  template <class Accept>
  void gather_scope(const ChainIndex& index, int scope, const std::vector<int32_t>& ctx,
                    Accept accept, std::vector<Occurrence>& occ) const;
  bool in_group_scope(int32_t seq, int32_t own_slot, int32_t group) const;
  void maybe_evict();
  void rebuild_shared();
  void check_ids(const int64_t* ids, size_t n, bool must_exist) const;

  CoreConfig cfg_;                                     // immutable settings
  mutable std::mutex mu_;                              // serialises every public call
  std::vector<Sequence> seqs_;                         // sequence slots (dead ones reused)
  std::vector<int32_t> free_slots_;                    // dead slots no index refers to any more
  std::unordered_map<int64_t, RequestState> requests_; // live requests by id
  std::unordered_map<int32_t, ChainIndex> groups_;     // group scope indexes by group_id
  ChainIndex global_;                                  // global scope index
  int64_t step_ = 0;                                   // current RL step
  uint64_t next_order_ = 0;                            // creation counter for eviction ties
  int64_t stored_tokens_ = 0;                          // tokens over all alive sequences
  int64_t evictions_ = 0;                              // sequences evicted so far
  mutable std::vector<Occurrence> occ_;                // scratch for propose
  mutable DraftBuilder builder_;                       // scratch trie and heap for propose
};

}  // namespace rollout_spec
