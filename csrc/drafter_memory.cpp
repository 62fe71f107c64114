// Capacity, eviction, statistics and self-checks of DrafterCore.
#include <algorithm>

#include "drafter_core.h"

namespace rollout_spec {

void DrafterCore::maybe_evict() {
  if (stored_tokens_ <= cfg_.capacity_tokens) return;
  std::vector<int32_t> victims;
  for (int32_t i = 0; i < static_cast<int32_t>(seqs_.size()); ++i) {
    const Sequence& s = seqs_[i];
    if (s.alive && !s.live && !s.pinned) victims.push_back(i);
  }
  std::sort(victims.begin(), victims.end(), [&](int32_t a, int32_t b) {
    return seqs_[a].step != seqs_[b].step ? seqs_[a].step < seqs_[b].step
                                          : seqs_[a].order < seqs_[b].order;
  });
  // Evict down to half the capacity so that the O(stored) rebuild below is amortised over at
  // least capacity/2 newly stored tokens (one re-insert per stored token, on average).
  const int64_t target = cfg_.capacity_tokens / 2;
  std::vector<int32_t> freed;
  for (int32_t v : victims) {
    if (stored_tokens_ <= target) break;
    Sequence& s = seqs_[v];
    stored_tokens_ -= static_cast<int64_t>(s.tokens.size());
    s = Sequence{};  // alive = false, tokens released
    refresh_view(v);
    freed.push_back(v);
    ++evictions_;
  }
  if (freed.empty()) return;
  drop_ahead();  // its drafts may point into freed (soon reused) slots
  rebuild_shared();
  free_slots_.insert(free_slots_.end(), freed.begin(), freed.end());
}

bool DrafterCore::release_if_empty(int32_t slot) {
  Sequence& s = seqs_[slot];
  if (s.live || !s.tokens.empty()) return false;
  s = Sequence{};
  refresh_view(slot);
  free_slots_.push_back(slot);
  return true;
}

void DrafterCore::rebuild_shared() {
  auto tokens_of = [&](int32_t seq) { return seqs_[seq].tokens.data(); };
  auto alive = [&](int32_t seq) { return seqs_[seq].alive; };
  global_.rebuild(alive, tokens_of);
  for (auto it = groups_.begin(); it != groups_.end();) {
    it->second.rebuild(alive, tokens_of);
    it = it->second.empty() ? groups_.erase(it) : std::next(it);
  }
}

CoreStats DrafterCore::stats() const {
  auto lock = lock_idle();
  CoreStats st;
  st.num_requests = static_cast<int64_t>(requests_.size());
  st.index_tokens = stored_tokens_;
  st.step = step_;
  st.num_groups = static_cast<int64_t>(groups_.size());
  st.evictions = evictions_;
  st.proposals = proposals_;
  st.ahead_hits = ahead_hits_;
  st.ahead_dropped = ahead_dropped_;
  int64_t mem = sizeof(*this) + seqs_.capacity() * sizeof(Sequence) +
                free_slots_.capacity() * sizeof(int32_t);
  for (const Sequence& s : seqs_) {
    st.num_sequences += s.alive;
    mem += static_cast<int64_t>(s.tokens.capacity() * sizeof(int32_t));
  }
  for (const auto& [id, req] : requests_) {
    st.request_records += req.own.num_records();
    mem += req.own.memory_bytes() + 32;  // + hash node overhead
  }
  for (const auto& [g, index] : groups_) {
    st.group_records += index.num_records();
    mem += index.memory_bytes() + 32;
  }
  st.global_records = global_.num_records();
  st.memory_bytes = mem + global_.memory_bytes();
  return st;
}

std::string DrafterCore::check_integrity() const {
  auto lock = lock_idle();
  return integrity_problem();
}

std::string DrafterCore::integrity_problem() const {
  auto tokens_of = [&](int32_t seq) { return seqs_[seq].tokens.data(); };
  int64_t stored = 0;
  size_t live = 0;
  for (const Sequence& s : seqs_) {
    if (!s.alive && !s.tokens.empty()) return "dead sequence still holds tokens";
    if (s.alive && !s.live && s.tokens.empty()) return "finished sequence without tokens still kept";
    stored += static_cast<int64_t>(s.tokens.size());
    live += s.live;
  }
  if (stored != stored_tokens_) return "stored token count out of sync";
  if (live != requests_.size()) return "live sequences and requests differ in number";
  if (view_.size() != seqs_.size()) return "slot views out of sync with the slots";
  for (size_t i = 0; i < seqs_.size(); ++i) {
    const Sequence& s = seqs_[i];
    // finish's response length and the shared scopes' first indexed position read it.
    if (s.alive && (s.prompt_len < 0 || s.prompt_len > static_cast<int64_t>(s.tokens.size())))
      return "prompt length outside its sequence";
    const bool in_scope = s.alive && s.group >= 0 &&
                          (s.live || s.pinned || s.step >= step_ - cfg_.history_steps);
    if (view_[i].tokens != s.tokens.data() || view_[i].size != static_cast<int32_t>(s.tokens.size()) ||
        view_[i].scope_group != (in_scope ? s.group : -1))
      return "slot view differs from its sequence";
  }
  std::vector<bool> listed(seqs_.size(), false);
  for (int32_t f : free_slots_) {
    if (f < 0 || f >= static_cast<int32_t>(seqs_.size()) || seqs_[f].alive) return "free slot out of range or alive";
    if (listed[f]) return "free slot listed twice";  // two new requests would share it
    listed[f] = true;
  }
  for (const auto& [id, req] : requests_) {
    const Sequence& s = seqs_[req.slot];
    if (!s.alive || !s.live || s.req_id != id) return "request state points at a wrong sequence";
    // Every position with a next token is indexed, and no other.
    if (req.own.size() != s.positions_with_next())
      return "request index out of step with its own sequence";
    if (!req.own.check(s.tokens.data())) return "request index chains broken";
  }
  auto shared_ok = [&](const ChainIndex& index) {
    for (const ChainRecord& r : index.log())
      if (r.seq < 0 || r.seq >= static_cast<int32_t>(seqs_.size()) || !seqs_[r.seq].alive ||
          r.pos < 0 || int64_t{r.pos} + 1 >= static_cast<int64_t>(seqs_[r.seq].tokens.size()))
        return false;
    return index.check(tokens_of);
  };
  if (!shared_ok(global_)) return "global index refers to dead or short sequences";
  for (const auto& [g, index] : groups_) {
    if (!shared_ok(index)) return "group index refers to dead or short sequences";
    for (const ChainRecord& r : index.log())
      if (seqs_[r.seq].group != g) return "group index holds another group's sequence";
  }
  return "";
}

}  // namespace rollout_spec
