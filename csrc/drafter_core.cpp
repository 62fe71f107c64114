#include "drafter_core.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

namespace rollout_spec {

namespace {
constexpr int kRequestScope = 0;
constexpr int kGroupScope = 1;
constexpr int kGlobalScope = 2;
}  // namespace

DrafterCore::DrafterCore(const CoreConfig& cfg) : cfg_(cfg) {}

void DrafterCore::check_ids(const int64_t* ids, size_t n, bool must_exist) const {
  std::unordered_set<int64_t> seen;
  for (size_t i = 0; i < n; ++i) {
    if (!seen.insert(ids[i]).second)
      throw std::invalid_argument("req_ids: duplicate request id " + std::to_string(ids[i]));
    bool exists = requests_.count(ids[i]) != 0;
    if (must_exist && !exists)
      throw std::invalid_argument("req_ids: unknown request id " + std::to_string(ids[i]));
    if (!must_exist && exists)
      throw std::invalid_argument("req_ids: request id " + std::to_string(ids[i]) + " is already live");
  }
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

void DrafterCore::index_position(int32_t slot, RequestState* req, int32_t pos) {
  const Sequence& s = seqs_[slot];
  uint64_t keys[kNumKeys];
  ngram_keys(s.tokens.data(), pos, keys);
  if (req) req->own.insert_keys(slot, pos, keys);
  // Shared scopes only index positions whose continuation is a response token.
  if (pos < s.prompt_len - 1) return;
  if (s.group >= 0) groups_[s.group].insert_keys(slot, pos, keys);
  global_.insert_keys(slot, pos, keys);
}

void DrafterCore::start(const int64_t* ids, const int32_t* groups, const int32_t* tokens,
                        const int64_t* offsets, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  check_ids(ids, n, /*must_exist=*/false);
  for (size_t i = 0; i < n; ++i) {
    int32_t slot = new_slot();
    Sequence& s = seqs_[slot];
    s.tokens.assign(tokens + offsets[i], tokens + offsets[i + 1]);
    s.req_id = ids[i];
    s.group = groups[i];
    s.prompt_len = static_cast<int32_t>(s.tokens.size());
    s.live = true;
    stored_tokens_ += s.prompt_len;
    RequestState& req = requests_[ids[i]];
    req.slot = slot;
    for (int32_t p = 0; p < s.prompt_len; ++p) index_position(slot, &req, p);
  }
  maybe_evict();
}

void DrafterCore::extend(const int64_t* ids, const int32_t* tokens, const int64_t* offsets,
                         size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  check_ids(ids, n, /*must_exist=*/true);
  for (size_t i = 0; i < n; ++i) {
    RequestState& req = requests_.find(ids[i])->second;
    Sequence& s = seqs_[req.slot];
    int32_t first = static_cast<int32_t>(s.tokens.size());
    s.tokens.insert(s.tokens.end(), tokens + offsets[i], tokens + offsets[i + 1]);
    s.step = step_;
    stored_tokens_ += offsets[i + 1] - offsets[i];
    for (int32_t p = first; p < static_cast<int32_t>(s.tokens.size()); ++p)
      index_position(req.slot, &req, p);
  }
  maybe_evict();
}

void DrafterCore::finish(const int64_t* ids, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  check_ids(ids, n, /*must_exist=*/true);
  for (size_t i = 0; i < n; ++i) {
    auto it = requests_.find(ids[i]);
    Sequence& s = seqs_[it->second.slot];
    s.live = false;
    s.req_id = -1;
    s.step = step_;
    requests_.erase(it);
  }
  maybe_evict();
}

void DrafterCore::add_sequences(const int32_t* groups, const int32_t* tokens,
                                const int64_t* offsets, size_t n, bool pinned) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    int32_t slot = new_slot();
    Sequence& s = seqs_[slot];
    s.tokens.assign(tokens + offsets[i], tokens + offsets[i + 1]);
    s.group = groups[i];
    s.pinned = pinned;
    stored_tokens_ += static_cast<int64_t>(s.tokens.size());
    for (int32_t p = 0; p < static_cast<int32_t>(s.tokens.size()); ++p)
      index_position(slot, nullptr, p);
    // Evicting inside the loop keeps a huge ingest within capacity as it streams in.
    if (stored_tokens_ > cfg_.capacity_tokens) maybe_evict();
  }
  maybe_evict();
}

void DrafterCore::end_step() {
  std::lock_guard<std::mutex> lock(mu_);
  ++step_;
  // Aging: drop group records that fell out of the history window (they stay global).
  for (auto it = groups_.begin(); it != groups_.end();) {
    int32_t group = it->first;
    it->second.rebuild(
        [&](int32_t seq) { return in_group_scope(seq, -1, group); },
        [&](int32_t seq) { return seqs_[seq].tokens.data(); });
    it = it->second.empty() ? groups_.erase(it) : std::next(it);
  }
}

bool DrafterCore::in_group_scope(int32_t seq, int32_t own_slot, int32_t group) const {
  const Sequence& s = seqs_[seq];
  return seq != own_slot && s.alive && s.group == group && group >= 0 &&
         (s.live || s.pinned || s.step >= step_ - cfg_.history_steps);
}

bool DrafterCore::has_request(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_.count(id) != 0;
}

}  // namespace rollout_spec
