// The drafter: stored sequences, the request / group / global chain indexes, and proposals.
//
// Every public method takes the instance mutex, so one thread may extend while another
// proposes; bindings release the GIL around these calls. Batch inputs come as CSR arrays
// (ids[n], tokens[...], offsets[n+1]); all checks run before any state changes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "background_worker.h"
#include "chain_index.h"
#include "core_config.h"
#include "core_stats.h"
#include "draft_builder.h"
#include "draft_output.h"
#include "occurrence.h"
#include "request_state.h"
#include "sequence.h"
#include "slot_view.h"
#include "thread_pool.h"

namespace rollout_spec {

class DrafterCore {
 public:
  explicit DrafterCore(const CoreConfig& cfg);
  ~DrafterCore();

  void start(const int64_t* ids, const int32_t* groups, const int32_t* tokens,
             const int64_t* offsets, size_t n);
  void extend(const int64_t* ids, const int32_t* tokens, const int64_t* offsets, size_t n);
  // extend that returns once the tokens are checked and appended; their indexing runs on the
  // core's background thread, and every later call waits for it first (so it sees the same
  // state as after extend). Bad ids throw here, with nothing changed.
  void extend_in_background(const int64_t* ids, const int32_t* tokens, const int64_t* offsets,
                            size_t n);
  void finish(const int64_t* ids, size_t n);
  // The verifier's noise keys of live requests (rollout_spec/noise.py: a seed per request, -1
  // for none, the temperatures (> 0) their tokens are sampled at, and the quarter block q of
  // the vocabulary's column layout): their proposals rank siblings by the race they will meet
  // (DraftBuilder::race_ratios).
  void set_noise(const int64_t* ids, const int64_t* seeds, const double* temperatures, size_t n,
                 uint32_t q);
  // Start the proposal for (ids, budgets) on the background thread, behind any pending
  // indexing, and return at once (the engine calls it right after a drafting step's extend, so
  // the next step's proposal is made while it commits). The next propose with the same ids and
  // budgets returns exactly what it would have built: this proposal only reads the state, and
  // its match-state updates are applied by that call. Anything that changes what a proposal
  // reads first drops it (start, extend, add_sequences, end_step, load, a finish that evicts);
  // a propose with other arguments drops it and proposes afresh. An error (e.g. an unknown id)
  // drops it too: the propose call that follows meets the same error if it names those ids.
  void propose_ahead(const int64_t* ids, const int32_t* budgets, size_t n);
  // budgets may be null (each request gets num_draft_tokens). Calls of at least
  // parallel_min_requests requests are split over propose_threads threads; the result and the
  // state left behind are the same for every thread count.
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
  // The meta string of a saved state, the format checked but nothing else read.
  static std::string read_meta(std::istream& is);

 private:
  friend class ForkGuard;
  // Around a fork (fork_guard.h): wait for the calls and background jobs in progress and hold
  // the core's locks; then let them go in the parent, or replace them by fresh ones in the child.
  void hold_for_fork();
  void release_in_parent();
  void reset_in_child();
  // The instance mutex, once no background job (indexing, a proposal drafted ahead) is pending
  // (an error the indexing raised is rethrown here, once).
  std::unique_lock<std::mutex> lock_idle() const;
  // lock_idle for a call that changes what proposals read: `check` runs first and may throw
  // (a refused call changes nothing), then a proposal drafted ahead is dropped (finish, which
  // changes nothing other requests' proposals read, drops it only when it evicts).
  template <class Check>
  std::unique_lock<std::mutex> lock_to_change(Check&& check) {
    auto lock = lock_idle();
    check();
    drop_ahead();
    return lock;
  }
  void drop_ahead();
  // Free a stored sequence without tokens at once: it holds nothing to draft from, and it
  // would never count towards capacity, so eviction would never free it either.
  bool release_if_empty(int32_t slot);
  // Whether a live request outside ids[0..n) has noise keys (set_noise's vocabulary check).
  bool keyed_elsewhere(const int64_t* ids, size_t n) const;
  // check_integrity under a lock the caller holds.
  std::string integrity_problem() const;
  // What a call on ids[0..n) needs before it changes anything: the ids resolved into reqs_
  // (unknown or repeated ones raise) and, for a call that splits, the thread pool made.
  void prepare_call(const int64_t* ids, size_t n);
  // extend's two halves: append tokens (to reqs_, resolved by prepare_call); index them.
  void append_tokens(const int32_t* tokens, const int64_t* offsets, size_t n);
  void index_extended(const int64_t* offsets, size_t n);
  int32_t new_slot();
  // A new, empty global scope index: its chains keep what a search of either walk length reads.
  static ChainIndex empty_global_index(const CoreConfig& cfg);
  // The group scope index of `group`, created empty if missing.
  ChainIndex& group_index(int32_t group);
  // Copy slot's hot fields into view_ (after any change to its tokens, step, liveness, group).
  void refresh_view(int32_t slot);
  void refresh_all_views();
  // Index position `pos` of an ingested sequence in its group and the global scope.
  void index_shared(int32_t slot, int32_t pos);
  // Index the positions extend just appended (all keys hashed and prefetched, then inserted);
  // a call that splits() is spread over the pool.
  void index_appended(const int64_t* offsets, size_t n);
  // A request's chain search, split in stages (keys and slot prefetches, heads and block
  // prefetches, the walk) so that propose can run the first two a request or two ahead.
  struct Lookup {
    const RequestIndex* own_index;            // the request scope's; null: not searched
    const ChainIndex* index[3];               // the group and global scopes' ([1], [2]; [0] stays
                                              // null); null: not searched
    uint64_t keys[kNumKeys];
    int32_t own_newest[kNumKeys];             // filled by lookup_heads: the request scope's chains
    const ChainHead* heads[3][kNumKeys];      // ... and the other scopes'
    int32_t own;                              // the request's slot
    int32_t group;
    bool use_group;
  };
  void lookup_slots(const RequestState& req, Lookup& lk) const;
  void lookup_heads(Lookup& lk) const;
  void lookup_walk(const Lookup& lk, std::vector<Occurrence>& occ) const;
  // The race key of req's next proposal (none without a seed).
  RaceKey race_key(const RequestState& req) const {
    if (req.noise_seed < 0) return {};
    return RaceKey{req.noise_seed, static_cast<int64_t>(view_[req.slot].size) - 1, noise_q_,
                   req.noise_temperature};
  }
  // Calls draft(i, lookup) for the request indices next() yields, each request's search started
  // two requests ahead (see drafter_propose.cpp).
  template <class Next, class Draft>
  void pipelined(Next next, Draft draft) const;
  // propose on the calling thread.
  void propose_sequential(const int32_t* budgets, size_t n, DraftOutput& out);
  // Every tree built with its own budget into the workers' outputs (on the pool when `parallel`,
  // else on the calling thread), reading the state only; commit_parallel then cuts them in
  // request order.
  void draft_all(const int32_t* budgets, size_t n, bool parallel);
  // Whether a call of n requests is split over the pool.
  bool splits(size_t n) const {
    return threads_ > 1 && n >= static_cast<size_t>(cfg_.parallel_min_requests) && n > 1;
  }
  // Walk request i's search and build its tree into worker w's output.
  void draft_one(size_t i, int32_t budget, int w, const Lookup& lk);
  // Append requests' trees to out in order under the batch cap.
  void commit_parallel(const int32_t* budgets, size_t n, DraftOutput& out);
  // The pool, made on first use (again in a forked child, which has no copy of its threads).
  ThreadPool& pool();
  // Chain records a search reads per key length: chain_walk, but global_unigram_walk for the
  // global scope's 1-gram chains (at T=1.0 most evidence is a one-token match on other rollouts).
  int32_t walk(int scope, int ki) const {
    return scope == 2 && kKeyLens[ki] == 1 ? cfg_.global_unigram_walk : cfg_.chain_walk;
  }
  // One scope's part of a search: offers(ki, longer, take) hands the records of the scope's
  // chain of key length kKeyLens[ki] to take, newest first, until take returns true (the scope
  // is full; offers then returns true too); accept(seq) says whether a record's sequence is in
  // the scope.
  template <class Offers, class Accept>
  void gather_scope(int scope, const SlotView& ctx, Offers offers, Accept accept,
                    std::vector<Occurrence>& occ) const;
  // The request scope's chains for gather_scope (records filtered to the context's n-gram).
  void gather_own(const Lookup& lk, const SlotView& ctx, std::vector<Occurrence>& occ) const;
  // A group or global scope's chains for gather_scope.
  template <class Accept>
  void gather_shared(const Lookup& lk, int scope, const SlotView& ctx, Accept accept,
                     std::vector<Occurrence>& occ) const;
  // Inline: the search's global scope asks it for every record it reads.
  bool in_group_scope(int32_t seq, int32_t own_slot, int32_t group) const {
    return seq != own_slot && group >= 0 && view_[seq].scope_group == group;
  }
  void maybe_evict();
  void rebuild_shared();
  void check_ids(const int64_t* ids, size_t n, bool must_exist) const;
  // Live states of ids into reqs_ (one hash lookup each); unknown or repeated ids throw.
  void resolve(const int64_t* ids, size_t n);

  CoreConfig cfg_;                                     // immutable settings
  mutable std::mutex mu_;                              // serialises every public call
  mutable std::condition_variable idle_;               // signalled when a background job ends
  // Queued jobs that own the state: changed under mu_ by the jobs, but raised by propose_ahead
  // without it (the job queues behind a running one instead of waiting for its lock).
  std::atomic<int> background_jobs_{0};
  // Held by extend_in_background from before its wait for idle until its job is posted, and by
  // propose_ahead around its post: an ahead job posted by another thread in between would run
  // before the indexing job and overwrite reqs_, which that job reads.
  std::mutex post_mu_;
  mutable std::exception_ptr indexing_error_;          // what it threw, for the next call
  std::vector<int64_t> background_offsets_;            // its CSR offsets (reqs_ holds its states)
  std::vector<Sequence> seqs_;                         // sequence slots (dead ones reused)
  std::vector<SlotView> view_;                         // hot fields of seqs_, same indexing
  std::vector<int32_t> free_slots_;                    // dead slots no index refers to any more
  std::unordered_map<int64_t, RequestState> requests_; // live requests by id
  std::unordered_map<int32_t, ChainIndex> groups_;     // group scope indexes by group_id
  ChainIndex global_;                                  // global scope index
  int64_t step_ = 0;                                   // current RL step
  uint32_t noise_q_ = 0;                               // the noise keys' quarter block (set_noise)
  uint64_t next_order_ = 0;                            // creation counter for eviction ties
  int64_t stored_tokens_ = 0;                          // tokens over all alive sequences
  int64_t evictions_ = 0;                              // sequences evicted so far
  int64_t proposals_ = 0;                              // request proposals with budget > 0
  double mean_response_ = 0.0;                         // recent finished responses' mean length
  int64_t finished_ = 0;                               // responses finished (caps mean's window)
  mutable DraftBuilder builder_;                       // scratch trie and heap for propose
  std::vector<Occurrence> occ_;                        // scratch: a search's occurrences
  std::vector<RequestState*> reqs_;                    // scratch: states of the current call's ids
  uint64_t call_ = 0;                                  // stamps reqs_ entries to catch repeated ids
  // Parallel propose: per-thread scratch, padded so that threads never write one cache line.
  struct alignas(64) Worker {
    DraftBuilder builder;
    std::vector<Occurrence> occ;  // scratch: a search's occurrences
    DraftOutput out;  // the trees this worker built, one offsets entry per request it took
  };
  struct Part {       // where request i's tree of the current call is
    int32_t worker;
    int32_t entry;    // its offsets entry in that worker's output
  };
  int threads_ = 1;                                    // resolved propose_threads
  std::unique_ptr<ThreadPool> pool_;                   // null until a call is split
  long pool_pid_ = 0;                                  // process that made pool_
  std::vector<Worker> workers_;
  std::vector<Part> parts_;                            // per request of the current call
  // A proposal drafted ahead (propose_ahead) and waiting for the propose call it was made for.
  struct Ahead {
    std::vector<int64_t> ids;
    std::vector<int32_t> budgets;
    bool has_budgets = false;
    bool ready = false;  // parts_ and workers_ hold its draft
  } ahead_;
  int64_t ahead_hits_ = 0;                             // proposals served from ahead_
  int64_t ahead_dropped_ = 0;                          // ahead proposals never used
  std::unique_lock<std::mutex> fork_post_, fork_state_;  // post_mu_ and mu_ across a fork
  // Last member: destroyed first, so its pending job still finds everything above.
  BackgroundWorker background_;
};

}  // namespace rollout_spec
