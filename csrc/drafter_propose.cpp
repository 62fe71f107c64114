// Proposal path: search each request's context in every scope, then build its tree.
#include "prefetch.h"
#include <algorithm>
#include <atomic>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <unistd.h>

#include "drafter_core.h"

namespace rollout_spec {

namespace {
// Tokens equal going backwards from ctx's end and from pos, at most `cap`. Four at a time while
// at least four remain on both sides (siblings' matches often run to the cap of 32).
inline int32_t match_back(const SlotView& ctx, const int32_t* seq, int32_t pos, int32_t cap) {
  const int32_t c = ctx.size - 1;
  const int32_t limit = std::min({cap, c + 1, pos + 1});
  int32_t m = 0;
#if defined(__SSE2__)
  for (; m + 4 <= limit; m += 4) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ctx.tokens + c - m - 3));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(seq + pos - m - 3));
    // Lanes 3, 2, 1, 0 hold offsets m, m+1, m+2, m+3 back: count equal lanes from the top.
    const unsigned differ = ~static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, b)))) & 0xFu;
    if (differ) return m + (__builtin_clz(differ) - 28);
  }
#endif
  while (m < limit && ctx.tokens[c - m] == seq[pos - m]) ++m;
  return m;
}
}  // namespace

template <class Offers, class Accept>
void DrafterCore::gather_scope(int scope, const SlotView& ctx, Offers offers, Accept accept,
                               std::vector<Occurrence>& occ) const {
  const size_t first = occ.size();
  const size_t cap = static_cast<size_t>(scope == 2 ? cfg_.global_max_occurrences : cfg_.max_occurrences);
  const int32_t c = ctx.size - 1;
  for (int ki = 0; ki < kNumKeys; ++ki) {
    if (occ.size() - first >= static_cast<size_t>(cfg_.enough_occurrences)) break;
    const int32_t k = kKeyLens[ki];
    const int32_t need = std::max(std::min(k, cfg_.max_match_len), cfg_.min_match_len);
    const size_t earlier = occ.size();  // this scope's occurrences from longer keys end here
    // True when the record's match goes on past the key: the token before its n-gram equals the
    // context's. Otherwise the match is exactly k tokens long, known without reading the record's
    // sequence (the key's own tokens are trusted to the 64-bit hash in the shared scopes, and
    // checked by gather_own in the request scope). The context's token is read
    // once per key: the occurrence writes below may alias ctx.tokens as far as the compiler
    // knows, so it was reloaded for every record. Where the context is no longer than the key it
    // is -2, which no `before` equals (stored tokens are >= 0, checked at the bindings, and -1
    // marks a record at its sequence's start), so one comparison decides.
    const int32_t ctx_before = c >= k ? ctx.tokens[c - k] : -2;
    auto longer = [&](int32_t before) { return before == ctx_before; };
    // Adds the occurrence of a record if it qualifies; true once the scope is full.
    auto take = [&](const ChainEntry& e) {
      const int32_t seq = e.seq, pos = e.pos;
      if (!accept(seq)) return false;
      int32_t m = std::min(k, cfg_.max_match_len);
      int32_t cached = 1;
      if (longer(e.before)) {
        // Only a match longer than k can have been taken already, through a longer key (a chain
        // lists a position once, so this key's own occurrences need no check).
        for (size_t j = first; j < earlier; ++j)
          if (occ[j].seq == seq && occ[j].pos == pos) return false;
        const SlotView& v = view_[seq];
        m = match_back(ctx, v.tokens, pos, cfg_.max_match_len);
        cached = std::min(kCachedNext, v.size - pos - 1);  // its line is loaded now anyway
      }
      if (m < need) return false;  // shorter than min_match_len
      Occurrence& o = occ.emplace_back();
      o.seq = seq;
      o.pos = pos;
      o.match_len = m;
      o.scope = scope;
      o.cached = cached;
      o.next[0] = e.after;
      for (int32_t d = 1; d < cached; ++d) o.next[d] = view_[seq].tokens[pos + 1 + d];
      // The tree reads the continuation past the cached tokens from the sequence itself, right
      // after this search: start loading that line now so that the misses overlap the search.
      const SlotView& v = view_[seq];
      if (pos + 1 + cached < v.size) prefetch_line(v.tokens + pos + 1 + cached);
      return occ.size() - first >= cap;
    };
    if (offers(ki, longer, take)) return;
  }
}

void DrafterCore::gather_own(const Lookup& lk, const SlotView& ctx, std::vector<Occurrence>& occ) const {
  const RequestIndex& own = *lk.own_index;
  const int32_t* t = ctx.tokens;
  const int32_t c = ctx.size - 1, slot = lk.own;
  auto offers = [&](int ki, auto, auto take) {
    const int32_t k = kKeyLens[ki], limit = walk(0, ki);
    // A chain may also hold another key's positions (RequestIndex): only positions whose
    // n-gram is the context's count. Every token read is the request's own.
    int32_t n = 0;
    for (int32_t p = lk.own_newest[ki]; p >= 0 && n < limit; p = own.older(ki, p)) {
      bool same = true;
      for (int32_t d = 0; d < k; ++d) same &= t[p - d] == t[c - d];
      if (!same) continue;
      ++n;
      if (take(ChainEntry{slot, p, p >= k ? t[p - k] : -1, t[p + 1]})) return true;
    }
    return false;
  };
  gather_scope(0, ctx, offers, [](int32_t) { return true; }, occ);
}

template <class Accept>
void DrafterCore::gather_shared(const Lookup& lk, int scope, const SlotView& ctx, Accept accept,
                                std::vector<Occurrence>& occ) const {
  const ChainIndex& index = *lk.index[scope];
  auto offers = [&](int ki, auto longer, auto take) {
    const ChainHead* h = lk.heads[scope][ki];
    if (!h) return false;
    if (take(h->newest)) return true;
    // The older records kept sit in one block, whose lines were prefetched with the heads.
    const ChainIndex::Older older = index.older(*h);
    const int32_t n = std::min(older.n, walk(scope, ki) - 1);
    if (n <= 0) return false;
    // The t-th newest is base[(last - t) % cap]: one division per chain, then a step down that
    // wraps (a division per record was a long-latency instruction in both loops).
    const int32_t newest = older.last % older.cap;
    for (int32_t t = 0, at = newest; t < n; ++t, at = ChainIndex::ring_down(at, older.cap)) {
      const ChainEntry& e = older.base[at];
      if (longer(e.before)) prefetch_line(view_[e.seq].tokens + e.pos);
    }
    for (int32_t t = 0, at = newest; t < n; ++t, at = ChainIndex::ring_down(at, older.cap))
      if (take(older.base[at])) return true;
    return false;
  };
  gather_scope(scope, ctx, offers, accept, occ);
}

// A request's search looks up the context's keys in every scope at once, in waves (stages): all
// table slots are prefetched, then all heads read and their blocks and tokens prefetched, then
// the chains walked, so that the misses of one wave overlap instead of queueing one behind the
// other. propose runs the first two stages a request or two ahead (see pipelined below).
//
// Stage 1: the context's keys, the scopes' indexes, and a prefetch of every table slot the
// lookup will start at. ctx.size == 0 leaves every index null (nothing to search).
void DrafterCore::lookup_slots(const RequestState& req, Lookup& lk) const {
  lk.own = req.slot;
  lk.group = seqs_[lk.own].group;
  lk.use_group = lk.group >= 0 && cfg_.scope_weight[1] > 0.0;
  lk.own_index = nullptr;
  lk.index[0] = lk.index[1] = lk.index[2] = nullptr;
  const SlotView& ctx = view_[lk.own];
  if (ctx.size == 0) return;
  if (cfg_.scope_weight[0] > 0.0) lk.own_index = &req.own;
  if (lk.use_group) {
    auto it = groups_.find(lk.group);
    if (it != groups_.end()) lk.index[1] = &it->second;
  }
  if (cfg_.scope_weight[2] > 0.0) lk.index[2] = &global_;
  ngram_keys(ctx.tokens, ctx.size - 1, lk.keys);  // 0 where the context is shorter than the key
  if (lk.own_index) lk.own_index->prefetch(lk.keys);
  for (const ChainIndex* ix : lk.index)
    if (ix) ix->prefetch(lk.keys);
}

// Stage 2: read the heads from their (by now loaded) slots, and prefetch the lines of their
// blocks that the walk will read and the head records' tokens that a longer match reads (for
// the request scope, its newest positions' tokens and chain entries).
void DrafterCore::lookup_heads(Lookup& lk) const {
  const SlotView& ctx = view_[lk.own];
  for (int ki = 0; ki < kNumKeys; ++ki) {
    const int32_t p = lk.own_index && lk.keys[ki] ? lk.own_index->newest(ki, lk.keys[ki]) : -1;
    lk.own_newest[ki] = p;
    if (p < 0) continue;
    prefetch_line(ctx.tokens + p);
    lk.own_index->prefetch_older(ki, p);
  }
  for (int sc = 1; sc < 3; ++sc)
    for (int ki = 0; ki < kNumKeys; ++ki) {
      const ChainHead* h = lk.index[sc] && lk.keys[ki] ? lk.index[sc]->head(ki, lk.keys[ki]) : nullptr;
      lk.heads[sc][ki] = h;
      if (!h) continue;
      // The head's tokens are read only if its match is longer than the key.
      const ChainEntry& e = h->newest;
      if (e.before >= 0 && ctx.size > kKeyLens[ki] && ctx.tokens[ctx.size - 1 - kKeyLens[ki]] == e.before)
        prefetch_line(view_[e.seq].tokens + e.pos);
      ChainIndex::prefetch(lk.index[sc]->older(*h), walk(sc, ki) - 1);
    }
}

// Stage 3: walk the chains of every scope into occ.
void DrafterCore::lookup_walk(const Lookup& lk, std::vector<Occurrence>& occ) const {
  occ.clear();
  const SlotView& ctx = view_[lk.own];
  const int32_t own = lk.own, group = lk.group;
  const bool use_group = lk.use_group;
  if (lk.own_index) gather_own(lk, ctx, occ);
  if (lk.index[1])
    gather_shared(lk, 1, ctx, [&](int32_t seq) { return in_group_scope(seq, own, group); }, occ);
  if (lk.index[2])
    gather_shared(lk, 2, ctx,
                  [&](int32_t seq) { return seq != own && !(use_group && in_group_scope(seq, own, group)); },
                  occ);
}

void DrafterCore::propose(const int64_t* ids, const int32_t* budgets, size_t n, DraftOutput& out) {
  auto lock = lock_idle();
  prepare_call(ids, n);  // refusals raise before a proposal drafted ahead is used or dropped
  if (ahead_.ready) {
    const bool same = ahead_.ids.size() == n && std::equal(ids, ids + n, ahead_.ids.begin()) &&
                      ahead_.has_budgets == (budgets != nullptr) &&
                      (!budgets || std::equal(budgets, budgets + n, ahead_.budgets.begin()));
    if (same) {  // the same states as when drafted: nothing changed them since
      ahead_.ready = false;
      ++ahead_hits_;
      commit_parallel(budgets, n, out);
      return;
    }
    drop_ahead();
  }
  if (splits(n)) {
    draft_all(budgets, n, true);
    commit_parallel(budgets, n, out);
    return;
  }
  propose_sequential(budgets, n, out);
}

// One request's search is a chain of dependent misses (table slot -> head -> block and tokens),
// which prefetching inside the request cannot overlap. So the searches are software-pipelined
// across requests: while request i is searched and its tree built, the request two ahead has its
// keys hashed and table slots prefetched, and the next one its heads read from its (by now
// loaded) slots and their blocks and tokens prefetched; request i's walk then finds its lines
// loaded. One request ahead per stage is enough (a request costs a few microseconds, far more
// than a miss); 4 and 6 measured the same or worse. The lookups of a request that gets no draft
// (budget or batch cap) are dropped. `next()` yields the request indices in order (-1 once there
// are no more); `draft(i, lk)` gets request i's search with its first two stages run.
template <class Next, class Draft>
void DrafterCore::pipelined(Next next, Draft draft) const {
  constexpr int64_t kAhead = 2;  // stage 1 runs kAhead requests ahead, stage 2 one
  constexpr int64_t kRing = 4;   // > kAhead: the k-th request taken is in slot k % kRing
  int64_t req[kRing];
  Lookup ring[kRing];
  int64_t taken = 0;
  bool more = true;
  auto stage1 = [&] {  // take the next request and start its search
    const int64_t i = more ? next() : -1;
    if (i < 0) {
      more = false;
      return;
    }
    const int64_t r = taken++ % kRing;
    req[r] = i;
    lookup_slots(*reqs_[i], ring[r]);
  };
  auto stage2 = [&](int64_t k) {
    if (k < taken) lookup_heads(ring[k % kRing]);
  };
  for (int64_t k = 0; k < kAhead; ++k) stage1();
  stage2(0);
  for (int64_t k = 0; k < taken; ++k) {
    stage1();
    stage2(k + 1);
    const int64_t r = k % kRing;
    draft(req[r], ring[r]);
  }
}

void DrafterCore::propose_sequential(const int32_t* budgets, size_t n, DraftOutput& out) {
  out = DraftOutput{};
  out.offsets.reserve(n + 1);
  int64_t left = cfg_.max_batch_draft_tokens;
  int64_t next = 0;
  const int64_t end = static_cast<int64_t>(n);
  pipelined([&] { return next < end ? next++ : int64_t(-1); },
            [&](int64_t i, const Lookup& lk) {
              const int64_t want = budgets ? budgets[i] : cfg_.num_draft_tokens;
              const int32_t budget = static_cast<int32_t>(std::min<int64_t>(want, left));
              if (budget <= 0) {
                out.offsets.push_back(out.offsets.back());
                return;
              }
              ++proposals_;
              lookup_walk(lk, occ_);
              builder_.build(occ_, view_, cfg_, budget, out, race_key(*reqs_[i]));
              left -= out.offsets.back() - out.offsets[out.offsets.size() - 2];
            });
}

// Why building every tree with its whole budget and cutting it later is exact: the builder emits
// nodes in one fixed order (distinct heap keys), and a smaller budget only drops heap entries
// that could not come out within it (siblings beyond the room left, children deeper than the
// budget), so the tree built with budget m is the first m nodes of the one built with b > m.
void DrafterCore::draft_all(const int32_t* budgets, size_t n, bool parallel) {
  const size_t width = parallel ? static_cast<size_t>(pool().size()) : 1;
  if (workers_.size() < width) workers_.resize(width);
  for (Worker& w : workers_) {
    w.out.offsets.assign(1, 0);
    w.out.tokens.clear();
    w.out.parents.clear();
    w.out.probs.clear();
  }
  parts_.resize(n);
  const int64_t cap = cfg_.max_batch_draft_tokens;
  // Small chunks taken in turn balance requests of very different cost.
  constexpr size_t kChunk = 4;
  std::atomic<size_t> next{0};
  auto work = [&](int w) {
    // This worker's requests, chunk by chunk, with their searches pipelined as on one thread.
    size_t at = 0, stop = 0;
    auto mine = [&]() -> int64_t {
      if (at == stop) {
        at = next.fetch_add(kChunk, std::memory_order_relaxed);
        if (at >= n) return -1;
        stop = std::min(n, at + kChunk);
      }
      return static_cast<int64_t>(at++);
    };
    pipelined(mine, [&](int64_t i, const Lookup& lk) {
      const int64_t want = budgets ? budgets[i] : cfg_.num_draft_tokens;
      draft_one(static_cast<size_t>(i), static_cast<int32_t>(std::min<int64_t>(want, cap)), w, lk);
    });
  };
  if (parallel) {
    pool().run(work);
  } else {
    work(0);
  }
}

void DrafterCore::draft_one(size_t i, int32_t budget, int w, const Lookup& lk) {
  Worker& worker = workers_[w];
  DraftOutput& mine = worker.out;
  Part& part = parts_[i];
  part.worker = w;
  part.entry = static_cast<int32_t>(mine.offsets.size()) - 1;
  if (budget <= 0) {
    mine.offsets.push_back(mine.offsets.back());
    return;
  }
  lookup_walk(lk, worker.occ);
  worker.builder.build(worker.occ, view_, cfg_, budget, mine, race_key(*reqs_[i]));
}

void DrafterCore::commit_parallel(const int32_t* budgets, size_t n, DraftOutput& out) {
  out = DraftOutput{};
  out.offsets.reserve(n + 1);
  int64_t left = cfg_.max_batch_draft_tokens;
  for (size_t i = 0; i < n; ++i) {
    const int64_t want = budgets ? budgets[i] : cfg_.num_draft_tokens;
    const int64_t budget = std::min<int64_t>(want, left);
    if (budget <= 0) {
      out.offsets.push_back(out.offsets.back());
      continue;
    }
    ++proposals_;
    const Part& part = parts_[i];
    const DraftOutput& src = workers_[part.worker].out;
    const int32_t begin = src.offsets[part.entry];
    const int32_t size = static_cast<int32_t>(std::min<int64_t>(src.offsets[part.entry + 1] - begin, budget));
    out.tokens.insert(out.tokens.end(), src.tokens.begin() + begin, src.tokens.begin() + begin + size);
    out.parents.insert(out.parents.end(), src.parents.begin() + begin, src.parents.begin() + begin + size);
    out.probs.insert(out.probs.end(), src.probs.begin() + begin, src.probs.begin() + begin + size);
    out.offsets.push_back(out.offsets.back() + size);
    left -= size;
  }
}

ThreadPool& DrafterCore::pool() {
  const long pid = static_cast<long>(getpid());
  if (pool_ && pool_pid_ != pid) {
    // A forked child: the parent's workers do not exist here and their pool cannot be joined or
    // destroyed safely, so it is left behind and a new one made.
    (void)pool_.release();
  }
  if (!pool_) {
    pool_ = std::make_unique<ThreadPool>(threads_);
    pool_pid_ = pid;
  }
  return *pool_;
}

}  // namespace rollout_spec
