#include "drafter_core.h"

#include "fork_guard.h"
#include "prefetch.h"
#include "race_noise.h"

#include <algorithm>
#include <new>
#include <stdexcept>
#include <thread>
#include <unordered_set>
#include <utility>

#include <unistd.h>

namespace rollout_spec {
namespace {

// Most response positions a new request's own tables are sized for ahead (start).
constexpr double kMaxReservedResponse = 16384.0;

}  // namespace

DrafterCore::DrafterCore(const CoreConfig& cfg)
    : cfg_(cfg), global_(empty_global_index(cfg)) {
  // Chains keep only the records a search may read (ChainPool's classes go up to 4095).
  if (cfg.chain_walk < 1 || cfg.chain_walk > 4096)
    throw std::invalid_argument("chain_walk must be in [1, 4096], got " + std::to_string(cfg.chain_walk));
  if (cfg.global_unigram_walk < 1 || cfg.global_unigram_walk > 4096)
    throw std::invalid_argument("global_unigram_walk must be in [1, 4096], got " +
                                std::to_string(cfg.global_unigram_walk));
  if (cfg.propose_threads < 0 || cfg.propose_threads > 256)
    throw std::invalid_argument("propose_threads must be in [0, 256], got " + std::to_string(cfg.propose_threads));
  if (cfg.parallel_min_requests < 1)
    throw std::invalid_argument("parallel_min_requests must be >= 1, got " + std::to_string(cfg.parallel_min_requests));
  // Auto: half the hardware threads (the other half feeds the GPU), at most 8 (propose is
  // memory bound; more threads mostly queue on the same misses).
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  threads_ = cfg.propose_threads > 0 ? cfg.propose_threads : std::max(1, std::min(8, hw / 2));
  ForkGuard::add(this);  // last: a constructor that throws never registers
}

DrafterCore::~DrafterCore() {
  ForkGuard::remove(this);
  // A forked child's copy of the parent's pool names threads that do not exist here, and its
  // condition variables may count them as waiters: it is left behind, as pool() does.
  if (pool_ && pool_pid_ != static_cast<long>(getpid())) (void)pool_.release();
}

ChainIndex DrafterCore::empty_global_index(const CoreConfig& cfg) {
  return ChainIndex(std::max(cfg.chain_walk, cfg.global_unigram_walk), kGlobalKeys);
}

ChainIndex& DrafterCore::group_index(int32_t group) {
  return groups_.try_emplace(group, cfg_.chain_walk, kGroupKeys).first->second;
}

void DrafterCore::check_ids(const int64_t* ids, size_t n, bool must_exist) const {
  std::unordered_set<int64_t> seen;
  for (size_t i = 0; i < n; ++i) {
    if (!seen.insert(ids[i]).second)
      throw std::invalid_argument("req_ids must not repeat a request id: " + std::to_string(ids[i]));
    bool exists = requests_.count(ids[i]) != 0;
    if (must_exist && !exists)
      throw std::invalid_argument("req_ids: unknown request id " + std::to_string(ids[i]));
    if (!must_exist && exists)
      throw std::invalid_argument("req_ids: request id " + std::to_string(ids[i]) + " is already live");
  }
}

void DrafterCore::resolve(const int64_t* ids, size_t n) {
  reqs_.resize(n);
  const uint64_t call = ++call_;
  for (size_t i = 0; i < n; ++i) {
    auto it = requests_.find(ids[i]);
    if (it == requests_.end())
      throw std::invalid_argument("req_ids: unknown request id " + std::to_string(ids[i]));
    if (it->second.call == call)
      throw std::invalid_argument("req_ids must not repeat a request id: " + std::to_string(ids[i]));
    it->second.call = call;
    reqs_[i] = &it->second;
    // The call reads every line of each state (its own index's fields, its noise key) once
    // per request, in a later pass: start loading them now, so that those misses overlap here
    // rather than stall that pass one request at a time (the states of a call fit in L2).
    const char* p = reinterpret_cast<const char*>(&it->second);
    for (size_t off = 64; off < sizeof(RequestState); off += 64) prefetch_line(p + off);
    prefetch_line(p + sizeof(RequestState) - 1);
  }
}

void DrafterCore::refresh_view(int32_t slot) {
  if (view_.size() < seqs_.size()) view_.resize(seqs_.size());
  const Sequence& s = seqs_[slot];
  const bool in_scope = s.alive && s.group >= 0 &&
                        (s.live || s.pinned || s.step >= step_ - cfg_.history_steps);
  view_[slot] = SlotView{s.tokens.data(), static_cast<int32_t>(s.tokens.size()),
                         in_scope ? s.group : -1};
}

void DrafterCore::refresh_all_views() {
  view_.assign(seqs_.size(), SlotView{});
  for (int32_t i = 0; i < static_cast<int32_t>(seqs_.size()); ++i) refresh_view(i);
}

int32_t DrafterCore::new_slot() {
  int32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
    seqs_[slot] = Sequence{};
  } else {
    slot = static_cast<int32_t>(seqs_.size());
    seqs_.emplace_back();
  }
  Sequence& s = seqs_[slot];
  s.alive = true;
  s.step = step_;
  s.order = next_order_++;
  return slot;
}

void DrafterCore::index_shared(int32_t slot, int32_t pos) {
  const Sequence& s = seqs_[slot];
  // Shared scopes only index positions whose continuation is a response token.
  if (pos < s.prompt_len - 1) return;
  uint64_t keys[kNumKeys];
  ngram_keys(s.tokens.data(), pos, keys);
  if (s.group >= 0) group_index(s.group).insert(slot, pos, s.tokens.data(), keys);
  global_.insert(slot, pos, s.tokens.data(), keys);
}

void DrafterCore::start(const int64_t* ids, const int32_t* groups, const int32_t* tokens,
                        const int64_t* offsets, size_t n) {
  auto lock = lock_to_change([&] { check_ids(ids, n, /*must_exist=*/false); });
  for (size_t i = 0; i < n; ++i) {
    int32_t slot = new_slot();
    Sequence& s = seqs_[slot];
    s.tokens.assign(tokens + offsets[i], tokens + offsets[i + 1]);
    s.req_id = ids[i];
    s.group = groups[i];
    s.prompt_len = static_cast<int32_t>(s.tokens.size());
    s.live = true;
    stored_tokens_ += s.prompt_len;
    refresh_view(slot);
    RequestState& req = requests_[ids[i]];
    req.slot = slot;
    req.own = RequestIndex(kRequestKeys);
    // Its own tables sized for the prompt and a response as long as recent ones: grown from
    // 16 slots, each was rehashed again every time the response doubled the keys, inside the
    // decode loop (extend 6-11% cheaper on the shared traces). Sizes change no lookup result.
    // Capped: one very long response would otherwise size every later request's tables for it.
    req.own.reserve_positions(static_cast<size_t>(s.prompt_len) +
                              static_cast<size_t>(std::min(mean_response_, kMaxReservedResponse)));
    // A position is indexed once its next token exists: the prompt's last one at the first extend
    // (and only the request scope indexes prompt positions).
    req.own.insert_up_to(s.tokens.data(), s.positions_with_next());
  }
  maybe_evict();
}

std::unique_lock<std::mutex> DrafterCore::lock_idle() const {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return background_jobs_ == 0; });
  if (indexing_error_) std::rethrow_exception(std::exchange(indexing_error_, nullptr));
  return lock;
}

void DrafterCore::hold_for_fork() {
  // In extend_in_background's order: no job can be posted once post_mu_ is held.
  fork_post_ = std::unique_lock<std::mutex>(post_mu_);
  fork_state_ = std::unique_lock<std::mutex>(mu_);
  idle_.wait(fork_state_, [&] { return background_jobs_ == 0; });
}

void DrafterCore::release_in_parent() {
  fork_state_.unlock();
  fork_post_.unlock();
}

void DrafterCore::reset_in_child() {
  // The child's copies may count the parent's threads as waiters (see BackgroundWorker), so
  // they are replaced unlocked, never destroyed.
  (void)fork_state_.release();
  (void)fork_post_.release();
  new (&mu_) std::mutex();
  new (&post_mu_) std::mutex();
  new (&idle_) std::condition_variable();
}

void DrafterCore::drop_ahead() {
  if (!ahead_.ready) return;
  ahead_.ready = false;
  ++ahead_dropped_;
}

void DrafterCore::extend(const int64_t* ids, const int32_t* tokens, const int64_t* offsets,
                         size_t n) {
  auto lock = lock_to_change([&] { prepare_call(ids, n); });
  append_tokens(tokens, offsets, n);
  index_extended(offsets, n);
}

void DrafterCore::extend_in_background(const int64_t* ids, const int32_t* tokens,
                                       const int64_t* offsets, size_t n) {
  std::lock_guard<std::mutex> posting(post_mu_);  // before the wait: see post_mu_
  background_.start();  // a refused thread raises here, before anything changes
  auto lock = lock_to_change([&] { prepare_call(ids, n); });
  append_tokens(tokens, offsets, n);
  background_offsets_.assign(offsets, offsets + n + 1);
  ++background_jobs_;
  background_.post([this, n] {
    std::lock_guard<std::mutex> job_lock(mu_);
    try {
      index_extended(background_offsets_.data(), n);
    } catch (...) {
      indexing_error_ = std::current_exception();
    }
    --background_jobs_;
    idle_.notify_all();
  });
}

void DrafterCore::propose_ahead(const int64_t* ids, const int32_t* budgets, size_t n) {
  // Not the state's lock: the state belongs to a background indexing job now and then (right
  // after a drafting step's extend), and this job queues behind it instead of waiting for it
  // here. post_mu_ only keeps the post out of another thread's extend_in_background. The count
  // is raised before the post, on the caller's thread, so that caller's next call waits for
  // the job.
  Ahead job{std::vector<int64_t>(ids, ids + n),
            budgets ? std::vector<int32_t>(budgets, budgets + n) : std::vector<int32_t>{},
            budgets != nullptr, false};
  std::lock_guard<std::mutex> posting(post_mu_);
  background_.start();  // a refused thread raises here, before the count is raised
  ++background_jobs_;
  background_.post([this, job = std::move(job)]() mutable {
    std::lock_guard<std::mutex> job_lock(mu_);
    const size_t count = job.ids.size();
    // After a failed indexing the state is not what the caller expects; its error is kept for
    // the next call and nothing is drafted.
    if (!indexing_error_) {
      try {
        drop_ahead();  // an earlier one nobody asked for
        resolve(job.ids.data(), count);
        draft_all(job.has_budgets ? job.budgets.data() : nullptr, count, splits(count));
        ahead_ = std::move(job);
        ahead_.ready = true;
      } catch (...) {
        // Dropped: the propose call that follows raises the same error if it names these ids.
        ahead_.ready = false;
        ++ahead_dropped_;
      }
    }
    --background_jobs_;
    idle_.notify_all();
  });
}

void DrafterCore::prepare_call(const int64_t* ids, size_t n) {
  resolve(ids, n);
  if (splits(n)) pool();  // a refused thread raises here, not halfway through the indexing
}

void DrafterCore::append_tokens(const int32_t* tokens, const int64_t* offsets, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    Sequence& s = seqs_[reqs_[i]->slot];
    s.tokens.insert(s.tokens.end(), tokens + offsets[i], tokens + offsets[i + 1]);
    s.step = step_;
    stored_tokens_ += offsets[i + 1] - offsets[i];
    refresh_view(reqs_[i]->slot);
  }
}

void DrafterCore::index_extended(const int64_t* offsets, size_t n) {
  index_appended(offsets, n);
  maybe_evict();
}

void DrafterCore::index_appended(const int64_t* offsets, size_t n) {
  // Every record lands in a random slot of a large hash table and that chain's newest block.
  // Positions are hashed first; then, while inserting position j, the slots of position
  // j + kAhead are prefetched and the heads of position j + kAhead / 2 found (their slots kept
  // for the insert, which then does not probe again) and their blocks prefetched, so that the
  // misses of several positions overlap and their lines are still in L1 when used.
  struct Pending {
    RequestState* req;
    ChainIndex* group;  // null when the position is not indexed in a group scope
    bool shared;        // also indexed in the group and global scopes
    int32_t pos;
    uint64_t keys[kNumKeys];
    // Table slots of the heads the inserts update, per index (ChainIndex::prepare).
    uint32_t own_slots[kNumKeys], group_slots[kNumKeys], global_slots[kNumKeys];
  };
  constexpr size_t kAhead = 8;
  // Kept between calls; named through a reference, because pool workers run the lambdas below
  // and a thread_local named there would be the worker's own.
  thread_local std::vector<Pending> kept_pending;
  std::vector<Pending>& pending = kept_pending;
  pending.clear();
  for (size_t i = 0; i < n; ++i) {
    RequestState* req = reqs_[i];
    const Sequence& s = seqs_[req->slot];
    const int32_t size = static_cast<int32_t>(s.tokens.size());
    const int32_t added = static_cast<int32_t>(offsets[i + 1] - offsets[i]);
    if (added == 0) continue;
    // The newly appended tokens give a continuation to the previous last position and to every
    // new one but the last.
    const int32_t begin = std::max(size - added - 1, 0), end = size - 1;
    ChainIndex* group = (s.group >= 0 && begin < end) ? &group_index(s.group) : nullptr;
    for (int32_t p = begin; p < end; ++p) {
      Pending& e = pending.emplace_back();
      e.req = req;
      e.pos = p;
      e.shared = p >= s.prompt_len - 1;  // shared scopes index only response continuations
      e.group = e.shared ? group : nullptr;
      ngram_keys(s.tokens.data(), p, e.keys);
    }
  }
  // Inserts the positions `order` lists (all, in order, when null): into the request's own and
  // group indexes when `local`, into the global one when `global`.
  auto insert_all = [&](const std::vector<uint32_t>* order, bool local, bool global) {
    const size_t total = order ? order->size() : pending.size();
    auto at = [&](size_t j) -> Pending& { return pending[order ? (*order)[j] : j]; };
    // Four positions further ahead, the indexes' own fields of a request's first position (its
    // state was prefetched by resolve, but the inserts of the requests before it evict it
    // again), and with the slots, the ends of their logs.
    auto state = [&](size_t j) {
      const Pending& e = at(j);
      if (!local || (j > 0 && at(j - 1).req == e.req)) return;
      e.req->own.prefetch_self();
      if (e.group) e.group->prefetch_self();
    };
    auto slots = [&](const Pending& e) {
      if (local) {
        e.req->own.prefetch_entries(e.pos);
        if (e.group) e.group->prefetch_log_end();
        e.req->own.prefetch(e.keys);
        if (e.group) e.group->prefetch(e.keys);
      }
      if (global && e.shared) global_.prefetch(e.keys);
    };
    auto tails = [&](Pending& e) {
      if (local) {
        e.req->own.prepare(e.keys, e.own_slots);
        if (e.group) e.group->prepare(e.keys, e.group_slots);
      }
      if (global && e.shared) global_.prepare(e.keys, e.global_slots);
    };
    constexpr size_t kState = kAhead + 4;
    for (size_t j = 0; j < std::min(total, kState); ++j) state(j);
    for (size_t j = 0; j < std::min(total, kAhead); ++j) slots(at(j));
    for (size_t j = 0; j < std::min(total, kAhead / 2); ++j) tails(at(j));
    for (size_t j = 0; j < total; ++j) {
      if (j + kState < total) state(j + kState);
      if (j + kAhead < total) slots(at(j + kAhead));
      if (j + kAhead / 2 < total) tails(at(j + kAhead / 2));
      const Pending& e = at(j);
      const int32_t* tokens = view_[e.req->slot].tokens;
      if (local) {
        e.req->own.insert(e.keys, e.own_slots);
        if (e.group) e.group->insert(e.req->slot, e.pos, tokens, e.keys, e.group_slots);
      }
      if (global && e.shared) global_.insert(e.req->slot, e.pos, tokens, e.keys, e.global_slots);
    }
  };
  if (!splits(n)) {
    insert_all(nullptr, true, true);
    return;
  }
  // Split over the pool: the caller inserts into the global index (3 of a response position's 8
  // records, into the largest table), the other workers into the request and group indexes,
  // each taking whole groups (and ungrouped requests by slot), so that every index still gets
  // its records in the serial order and every index is written by one thread.
  const int others = pool().size() - 1;
  auto owner = [&](const RequestState& req) {
    const int32_t group = seqs_[req.slot].group;
    return 1 + static_cast<int>((group >= 0 ? group : req.slot) % others);
  };
  thread_local std::vector<std::vector<uint32_t>> kept_parts;
  std::vector<std::vector<uint32_t>>& parts = kept_parts;
  parts.resize(others + 1);
  for (auto& part : parts) part.clear();
  for (size_t j = 0; j < pending.size(); ++j) parts[owner(*pending[j].req)].push_back(static_cast<uint32_t>(j));
  pool().run([&](int w) {
    if (w == 0) {
      insert_all(nullptr, false, true);
      return;
    }
    insert_all(&parts[w], true, false);
  });
}

void DrafterCore::set_noise(const int64_t* ids, const int64_t* seeds, const double* temperatures,
                            size_t n, uint32_t q) {
  for (size_t i = 0; i < n; ++i)
    if (seeds[i] >= 0 && !(temperatures[i] > 0.0 && temperatures[i] <= 1e6))
      throw std::invalid_argument("temperatures of seeded requests must be in (0, 1e6]");
  if (q < 1 || q > kMaxNoiseQ) throw std::invalid_argument("q must be in [1, 2**29]");
  auto lock = lock_to_change([&] {
    check_ids(ids, n, /*must_exist=*/true);
    if (q != noise_q_ && keyed_elsewhere(ids, n))
      throw std::invalid_argument(
          "vocab_size gives another noise layout than the one other live requests were keyed with "
          "(one layout per drafter: their races would move)");
  });
  noise_q_ = q;
  for (size_t i = 0; i < n; ++i) {
    RequestState& req = requests_.find(ids[i])->second;
    req.noise_seed = seeds[i] < 0 ? -1 : seeds[i];
    req.noise_temperature = seeds[i] < 0 ? 1.0 : temperatures[i];
  }
}

bool DrafterCore::keyed_elsewhere(const int64_t* ids, size_t n) const {
  const std::unordered_set<int64_t> these(ids, ids + n);
  for (const auto& [id, req] : requests_)
    if (req.noise_seed >= 0 && these.count(id) == 0) return true;
  return false;
}

void DrafterCore::finish(const int64_t* ids, size_t n) {
  auto lock = lock_idle();
  check_ids(ids, n, /*must_exist=*/true);
  for (size_t i = 0; i < n; ++i) {
    auto it = requests_.find(ids[i]);
    const int32_t slot = it->second.slot;
    Sequence& s = seqs_[slot];
    // Mean over the finished responses, the last 1024 or so weighing most once there are more.
    const double len = static_cast<double>(s.tokens.size()) - s.prompt_len;
    mean_response_ += (len - mean_response_) / static_cast<double>(std::min<int64_t>(++finished_, 1024));
    s.live = false;
    s.req_id = -1;
    s.step = step_;
    refresh_view(slot);
    requests_.erase(it);
    release_if_empty(slot);
  }
  maybe_evict();
}

void DrafterCore::add_sequences(const int32_t* groups, const int32_t* tokens,
                                const int64_t* offsets, size_t n, bool pinned) {
  auto lock = lock_to_change([] {});
  for (size_t i = 0; i < n; ++i) {
    int32_t slot = new_slot();
    Sequence& s = seqs_[slot];
    s.tokens.assign(tokens + offsets[i], tokens + offsets[i + 1]);
    s.group = groups[i];
    s.pinned = pinned;
    stored_tokens_ += static_cast<int64_t>(s.tokens.size());
    refresh_view(slot);
    if (release_if_empty(slot)) continue;
    for (int32_t p = 0; p < s.positions_with_next(); ++p) index_shared(slot, p);
    // Evicting inside the loop keeps a huge ingest within capacity as it streams in.
    if (stored_tokens_ > cfg_.capacity_tokens) maybe_evict();
  }
  maybe_evict();
}

void DrafterCore::end_step() {
  auto lock = lock_to_change([] {});
  ++step_;
  refresh_all_views();  // Aging: drop group records that fell out of the history window (they stay global).
  for (auto it = groups_.begin(); it != groups_.end();) {
    int32_t group = it->first;
    it->second.rebuild(
        [&](int32_t seq) { return in_group_scope(seq, -1, group); },
        [&](int32_t seq) { return seqs_[seq].tokens.data(); });
    it = it->second.empty() ? groups_.erase(it) : std::next(it);
  }
}

bool DrafterCore::has_request(int64_t id) const {
  auto lock = lock_idle();
  return requests_.count(id) != 0;
}

}  // namespace rollout_spec
