"""Random operation sequences: the C++ drafter against a slow pure-Python model of its semantics.

``RefDrafter`` restates docs/drafter.md's rules with plain lists (no hashing, no chains): scopes,
newest-first occurrence search per key length (afresh at every proposal), weighted continuation
trie, best-first expansion (race-aware for requests told their noise keys), eviction by (step,
creation order), aging at end_step. Proposals must match node for node.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import heapq
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_spec import _core
from rollout_spec import drafter as drafter_mod
from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter, _core_config
from rollout_spec.noise import NOISE_TAG, quarter_block
from rollout_spec.tree import DraftBatch

KEYS = (4, 2, 1)
# The key lengths each scope's index keeps (csrc/scope_keys.h).
REQUEST_KEYS = (4, 1)
GROUP_KEYS = (4, 1)
GLOBAL_KEYS = (2, 1)
VOCAB = 5  # every test's tokens are below it

# The C library's single-precision log and log1p, which the core's ranking calls (numpy's may round their
# last bit differently).
_logf = ctypes.CDLL(ctypes.util.find_library("m")).logf
_logf.restype, _logf.argtypes = ctypes.c_float, [ctypes.c_float]
_log1pf = ctypes.CDLL(ctypes.util.find_library("m")).log1pf
_log1pf.restype, _log1pf.argtypes = ctypes.c_float, [ctypes.c_float]


def logf(x) -> np.float32:
    return np.float32(_logf(float(np.float32(x))))


def log1pf(x) -> np.float32:
    return np.float32(_log1pf(float(np.float32(x))))


def race_chances(ratios: list[float], tokens: list[int], seed: int, position: int, temperature: float) -> list[float]:
    """docs/drafter.md, "Race-aware proposals": the children's chances at a row racing at
    ``position``, from their evidence ratios, in the core's precision and order of operations."""
    warm = min(max((temperature - 0.6) / 0.4, 0.0), 1.0)
    power, kappa, lam = np.float32(1.5 / (temperature * temperature)), 1.0 - 0.5 * warm, 0.2 + 0.2 * warm
    u = _core.race_uniforms(np.array([seed], np.int64), np.array([position], np.int64), VOCAB,
                            quarter_block(VOCAB), NOISE_TAG)[0]
    seen, best, best_noise, leader = 0.0, np.float32(-np.inf), np.float32(0), -1
    for c, (r, tok) in enumerate(zip(ratios, tokens)):
        seen += r
        if r <= 0.0:
            continue
        noise = -logf(-log1pf(-u[tok]))  # verify's Gumbel draw
        score = power * logf(r) + noise
        if score > best:
            best, best_noise, leader = score, noise, c
    if leader < 0:
        return ratios
    r, unseen = ratios[leader], max(1.0 - kappa * seen, 0.0)
    sharp = math.exp(-unseen * math.exp(-(math.log(kappa * r) + float(best_noise))))
    chances = [x * kappa for x in ratios]
    chances[leader] = (1.0 - lam) * r + lam * sharp
    return chances


class RefDrafter:
    """Pure-Python model of DrafterCore (exact same outputs, none of its speed)."""

    def __init__(self, cfg: SpecConfig, capacity: int,
                 walk: int = drafter_mod.CHAIN_WALK, global_unigram_walk: int = drafter_mod.GLOBAL_UNIGRAM_WALK):
        self.cfg, self.capacity, self.walk, self.global_unigram_walk = cfg, capacity, walk, global_unigram_walk
        self.keys: dict[int, tuple[int, float]] = {}  # per live request told one: (seed, temperature)
        self.weights = (cfg.request_weight, cfg.group_weight, cfg.global_weight)
        self.seqs: list[dict] = []
        self.free: list[int] = []
        self.reqs: dict[int, int] = {}
        self.own: dict[int, list[list]] = {}
        self.groups: dict[int, list[list]] = {}
        self.glob: list[list] = [[] for _ in KEYS]
        self.step = self.order = self.stored = 0

    # -- storage
    def _slot(self, **fields) -> int:
        seq = dict(tokens=[], group=-1, prompt_len=0, live=False, pinned=False, alive=True,
                   step=self.step, order=self.order)
        seq.update(fields)
        self.order += 1
        if self.free:
            slot = self.free.pop()
            self.seqs[slot] = seq
        else:
            slot = len(self.seqs)
            self.seqs.append(seq)
        return slot

    def _index(self, slot: int, own: list | None, pos: int) -> None:
        s = self.seqs[slot]
        targets = [(own, REQUEST_KEYS)] if own is not None else []
        if pos >= s["prompt_len"] - 1:
            if s["group"] >= 0:
                targets.append((self.groups.setdefault(s["group"], [[] for _ in KEYS]), GROUP_KEYS))
            targets.append((self.glob, GLOBAL_KEYS))
        for index, keys in targets:
            for ki, k in enumerate(KEYS):
                if k in keys and pos + 1 >= k:
                    index[ki].append((slot, pos))

    def _in_group(self, seq: int, own: int, group: int) -> bool:
        s = self.seqs[seq]
        return (seq != own and s["alive"] and s["group"] == group and group >= 0 and
                (s["live"] or s["pinned"] or s["step"] >= self.step - self.cfg.history_steps))

    def _evict(self) -> None:
        if self.stored <= self.capacity:
            return
        victims = sorted((i for i, s in enumerate(self.seqs) if s["alive"] and not s["live"] and not s["pinned"]),
                         key=lambda i: (self.seqs[i]["step"], self.seqs[i]["order"]))
        target, freed = self.capacity // 2, []
        for v in victims:
            if self.stored <= target:
                break
            self.stored -= len(self.seqs[v]["tokens"])
            self.seqs[v] = dict(tokens=[], alive=False, live=False, pinned=False, group=-1, step=0, order=0)
            freed.append(v)
        if freed:
            for index in [self.glob, *self.groups.values()]:
                for ki in range(len(KEYS)):
                    index[ki] = [r for r in index[ki] if self.seqs[r[0]]["alive"]]
            self.free.extend(freed)

    # -- operations
    def start(self, ids, groups, prompts):
        for rid, g, p in zip(ids, groups, prompts):
            slot = self._slot(tokens=list(p), group=g, prompt_len=len(p), live=True)
            self.stored += len(p)
            self.reqs[rid] = slot
            self.own[rid] = [[] for _ in KEYS]
            for pos in range(len(p) - 1):  # a position is indexed once its next token exists
                self._index(slot, self.own[rid], pos)
        self._evict()

    def extend(self, ids, lists):
        for rid, toks in zip(ids, lists):
            slot = self.reqs[rid]
            s = self.seqs[slot]
            first = len(s["tokens"])
            s["tokens"].extend(toks)
            s["step"] = self.step
            self.stored += len(toks)
            for pos in range(max(first - 1, 0), len(s["tokens"]) - 1):
                self._index(slot, self.own[rid], pos)
        self._evict()

    def finish(self, ids):
        for rid in ids:
            s = self.seqs[self.reqs.pop(rid)]
            s.update(live=False, step=self.step)
            del self.own[rid]
            self.keys.pop(rid, None)
        self._evict()

    def set_keys(self, ids, seeds, temperatures):
        for rid, seed, t in zip(ids, seeds, temperatures):
            if seed is None:
                self.keys.pop(rid, None)
            else:
                self.keys[rid] = (seed, t)

    def add(self, groups, seqs):
        for g, toks in zip(groups, seqs):
            slot = self._slot(tokens=list(toks), group=g)
            self.stored += len(toks)
            for pos in range(len(toks) - 1):
                self._index(slot, None, pos)
            if self.stored > self.capacity:
                self._evict()
        self._evict()

    def end_step(self):
        self.step += 1
        for g, index in self.groups.items():
            for ki in range(len(KEYS)):
                index[ki] = [r for r in index[ki] if self._in_group(r[0], -1, g)]

    # -- proposals
    def _scope(self, index, scope, ctx, accept, occ):
        cfg, first = self.cfg, len(occ)
        cap = drafter_mod.GLOBAL_MAX_OCCURRENCES if scope == 2 else drafter_mod.MAX_OCCURRENCES
        for ki, k in enumerate(KEYS):
            limit = self.global_unigram_walk if scope == 2 and k == 1 else self.walk
            if len(occ) - first >= drafter_mod.ENOUGH_OCCURRENCES:
                break  # shorter keys only while too few were found
            if k > len(ctx):
                continue
            need = max(min(k, cfg.max_match_len), cfg.min_match_len)
            key, walked = ctx[-k:], 0
            for seq, pos in reversed(index[ki]):
                toks = self.seqs[seq]["tokens"]
                if toks[pos - k + 1:pos + 1] != key:
                    continue  # another chain
                if walked >= limit:
                    break
                walked += 1
                if not accept(seq) or any(o[0] == seq and o[1] == pos for o in occ[first:]):
                    continue
                m = 0
                while m < cfg.max_match_len and m < len(ctx) and pos - m >= 0 and ctx[-1 - m] == toks[pos - m]:
                    m += 1
                if m < need:
                    continue
                occ.append((seq, pos, m, scope))
                if len(occ) - first >= cap:
                    break

    def _gather(self, rid):
        own = self.reqs[rid]
        ctx, group = self.seqs[own]["tokens"], self.seqs[own]["group"]
        occ: list = []
        if not ctx:
            return occ
        use_group = group >= 0 and self.weights[1] > 0
        if self.weights[0] > 0:
            self._scope(self.own[rid], 0, ctx, lambda s: True, occ)
        if use_group and group in self.groups:
            self._scope(self.groups[group], 1, ctx, lambda s: self._in_group(s, own, group), occ)
        if self.weights[2] > 0:
            self._scope(self.glob, 2, ctx,
                        lambda s: s != own and not (use_group and self._in_group(s, own, group)), occ)
        return occ

    def _build(self, occ, budget, key=None):
        """key: (seed, root position, temperature) of a request told its noise keys, or None."""
        cfg = self.cfg
        # node: [token, parent, weight, count, children, prob, out_index, priority, depth]
        nodes = [[-1, -1, 0.0, 0, [], 1.0, -1, 1.0, 0]]
        depth = min(budget, cfg.max_depth)
        for seq, pos, m, scope in occ:
            w = self.weights[scope]
            for _ in range(drafter_mod.MATCH_POWER):
                w *= m
            toks = self.seqs[seq]["tokens"]
            nodes[0][2] += w
            cur = 0
            for t in toks[pos + 1:min(len(toks), pos + 1 + depth)]:
                nxt = next((c for c in nodes[cur][4] if nodes[c][0] == t), None)
                if nxt is None:
                    nxt = len(nodes)
                    nodes.append([t, cur, 0.0, 0, [], 0.0, -1, 0.0, nodes[cur][8] + 1])
                    nodes[cur][4].append(nxt)
                nodes[nxt][2] += w
                nodes[nxt][3] += 1
                cur = nxt
        beta, floor = drafter_mod.EVIDENCE_DISCOUNT, (cfg.min_token_prob if cfg.adaptive_budget else 0.0)
        heap: list = []

        def push(i):
            kids = nodes[i][4]
            if key is not None:  # the order follows the race at node i's row; the floor, the evidence
                seed, position, temperature = key
                ratios = [nodes[c][2] / nodes[i][2] * (nodes[c][3] / (nodes[c][3] + beta)) for c in kids]
                chances = race_chances(ratios, [nodes[c][0] for c in kids], seed,
                                       position + nodes[i][8], temperature)
            for k, c in enumerate(kids):
                n = float(nodes[c][3])
                ratio = nodes[c][2] / nodes[i][2]
                nodes[c][5] = nodes[i][5] * ratio
                if key is not None:
                    nodes[c][7] = nodes[i][7] * chances[k]
                else:
                    nodes[c][7] = nodes[i][7] * ratio * (n / (n + beta))
                heapq.heappush(heap, (-nodes[c][7], c))

        out = []
        if budget > 0 and occ:
            push(0)
            while len(out) < budget and heap:
                negp, i = heapq.heappop(heap)
                if nodes[i][5] < floor or -negp <= 0:
                    continue
                nodes[i][6] = len(out)
                parent = nodes[i][1]
                out.append((nodes[i][0], -1 if parent == 0 else nodes[parent][6], np.float32(-negp)))
                if not cfg.tree:
                    heap.clear()
                push(i)
        return out

    def propose(self, ids, budgets):
        left, trees = self.cfg.max_batch_draft_tokens, []
        for rid, b in zip(ids, budgets):
            budget = min(b, left)
            key = None
            if rid in self.keys:
                seed, temperature = self.keys[rid]
                key = (seed, len(self.seqs[self.reqs[rid]]["tokens"]) - 1, temperature)
            tree = self._build(self._gather(rid), budget, key) if budget > 0 else []
            left -= len(tree)
            trees.append(tree)
        return trees


def drafter_with_core(cfg: SpecConfig, **core_fields: int) -> NgramDrafter:
    """A facade whose core takes ``core_fields`` (CoreConfig's names) over what ``cfg`` gives it:
    knobs that SpecConfig does not expose (thread counts, chain walks) or keeps out of a test's
    reach (capacity's floor of 1024 tokens)."""
    d = NgramDrafter(cfg)
    core_cfg = _core_config(cfg)
    for name, value in core_fields.items():
        setattr(core_cfg, name, value)  # an unknown name raises AttributeError
    d._core = _core.DrafterCore(core_cfg)
    return d


def make_pair(cfg: SpecConfig, capacity: int,
              walk: int = drafter_mod.CHAIN_WALK,
              global_unigram_walk: int = drafter_mod.GLOBAL_UNIGRAM_WALK) -> tuple[NgramDrafter, RefDrafter]:
    """A facade whose core has a test-sized capacity (SpecConfig's floor is 1024 tokens) and the
    given chain walks (small values make the core's chains drop old records, and reuse their
    storage; the global index keeps the longer of the two)."""
    d = drafter_with_core(cfg, capacity_tokens=capacity, chain_walk=walk,
                          global_unigram_walk=global_unigram_walk)
    return d, RefDrafter(cfg, capacity, walk, global_unigram_walk)


def as_lists(batch) -> list[list[tuple[int, int, np.float32]]]:
    """DraftBatch -> per-request [(token, parent, prob)], after checking the contract the core's
    batches skip (``DraftBatch.trusted``) on a copy."""
    DraftBatch(offsets=batch.offsets, tokens=batch.tokens, parents=batch.parents,
               probs=batch.probs).validate()
    off = batch.offsets
    return [[(int(batch.tokens[i]), int(batch.parents[i]), batch.probs[i]) for i in range(off[b], off[b + 1])]
            for b in range(batch.num_requests)]


def best_path(tree: list[tuple[int, int, np.float32]]) -> list[int]:
    """Tokens along the first child at every level (siblings are ordered best first)."""
    path, cur = [], -1
    for i, (tok, parent, _) in enumerate(tree):
        if parent == cur:
            path.append(tok)
            cur = i
    return path


# A 3-token vocabulary: matches are long, chains are long and keys repeat.
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=12)
op_st = st.one_of(
    st.tuples(st.just("start"), st.lists(st.integers(0, 2), min_size=1, max_size=10), st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("extend"), st.integers(0, 7), tokens_st),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("propose"), st.integers(0, 3), st.integers(0, 9)),
    # an engine step: propose, accept the first n nodes of the best path, commit them + a bonus
    # (bonus -1: none, as when a request is cut at its length limit)
    st.tuples(st.just("accept"), st.integers(0, 7), st.integers(0, 4), st.integers(-1, 2)),
    st.tuples(st.just("add"), st.sampled_from([None, 0, 1, 3]), tokens_st),
    st.tuples(st.just("end_step")),
    # the request's noise keys (None: forget them)
    st.tuples(st.just("keys"), st.integers(0, 7), st.one_of(st.none(), st.integers(0, 2**63 - 1)),
              st.sampled_from([0.5, 0.6, 0.8, 1.0, 1.5])),
)
config_st = st.builds(
    SpecConfig,
    tree=st.booleans(),
    adaptive_budget=st.booleans(),
    min_token_prob=st.sampled_from([0.0, 0.1, 0.3]),
    max_depth=st.integers(1, 6),
    max_match_len=st.integers(1, 6),
    min_match_len=st.just(1),
    group_weight=st.sampled_from([0.0, 1.0, 2.0]),
    global_weight=st.sampled_from([0.0, 0.5]),
    request_weight=st.sampled_from([0.0, 1.0]),
    history_steps=st.integers(0, 2),
    max_batch_draft_tokens=st.integers(0, 20),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, capacity=st.integers(20, 80), ops=st.lists(op_st, min_size=1, max_size=40),
       walk=st.sampled_from([1, 2, 3, 5, drafter_mod.CHAIN_WALK]),
       global_unigram_walk=st.sampled_from([1, 2, 4, drafter_mod.GLOBAL_UNIGRAM_WALK]))
def test_random_operations_match_reference(cfg, capacity, ops, walk, global_unigram_walk):
    d, ref = make_pair(cfg, capacity, walk, global_unigram_walk)
    live: list[int] = []
    next_id = 0
    for op in ops:
        if op[0] == "start":
            d.start(next_id, op[1], op[2])
            ref.start([next_id], [-1 if op[2] is None else op[2]], [op[1]])
            live.append(next_id)
            next_id += 1
        elif op[0] == "extend" and live:
            rid = live[op[1] % len(live)]
            d.extend(rid, op[2])
            ref.extend([rid], [op[2]])
        elif op[0] == "finish" and live:
            rid = live.pop(op[1] % len(live))
            d.finish(rid)
            ref.finish([rid])
        elif op[0] == "propose" and live:
            ids = live[op[1] % len(live):]
            budgets = [op[2]] * len(ids)
            got = as_lists(d.propose(ids, budgets))
            assert got == ref.propose(ids, budgets)
        elif op[0] == "accept" and live:
            rid = live[op[1] % len(live)]
            got = as_lists(d.propose([rid]))
            assert got == ref.propose([rid], [cfg.num_draft_tokens])
            path = best_path(got[0])[:op[2]] + ([op[3]] if op[3] >= 0 else [])
            d.extend(rid, path)
            ref.extend([rid], [path])
        elif op[0] == "add":
            d.add_sequences([op[1]], [op[2]])
            ref.add([-1 if op[1] is None else op[1]], [op[2]])
        elif op[0] == "end_step":
            d.end_step()
            ref.end_step()
        elif op[0] == "keys" and live:
            rid = live[op[1] % len(live)]
            d.set_noise_keys([rid], [op[2]], [op[3]], VOCAB)
            ref.set_keys([rid], [op[2]], [op[3]])
        d.check_integrity()
        assert d.stats()["index_tokens"] == ref.stored
    if live:
        assert as_lists(d.propose(live)) == ref.propose(live, [cfg.num_draft_tokens] * len(live))


def test_chain_walk_reads_exactly_the_newest_records():
    """A chain longer than the walk: only its newest `walk` records are read, also after the
    core's fixed-size chain storage has wrapped around several times. These are global 1-gram
    chains, so global_unigram_walk is the walk; chain_walk (the other chains') varies around it."""
    cfg = SpecConfig(adaptive_budget=False, num_draft_tokens=8)
    for other, walk in ((1, 1), (2, 2), (5, 3), (1, 4), (5, 5), (3, 8), (16, 8)):
        d, ref = make_pair(cfg, 10**6, other, walk)
        for n in (3, 10, 40):
            seqs = [[1, 100 + len(ref.seqs) + i] for i in range(n)]  # token 1, then a new token
            d.add_sequences([None] * n, seqs)
            ref.add([-1] * n, seqs)
            rid = len(ref.seqs) + 1000
            d.start(rid, [1])
            ref.start([rid], [-1], [[1]])
            got = as_lists(d.propose([rid]))
            assert got == ref.propose([rid], [8])
            newest = [t for t, _, _ in got[0]]
            assert newest == [s["tokens"][-1] for s in reversed(ref.seqs) if len(s["tokens"]) == 2][:min(walk, 8)]
            d.check_integrity()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.builds(SpecConfig, tree=st.booleans(), adaptive_budget=st.booleans(),
                     min_token_prob=st.sampled_from([0.0, 0.05]), max_depth=st.integers(2, 12),
                     max_match_len=st.integers(1, 8), num_draft_tokens=st.integers(1, 24)),
       corpus=st.lists(st.tuples(st.sampled_from([None, 0, 1]),
                                 st.lists(st.integers(0, 4), min_size=2, max_size=16)),
                       min_size=1, max_size=30),
       prompts=st.lists(st.tuples(st.sampled_from([None, 0, 1]),
                                  st.lists(st.integers(0, 4), min_size=1, max_size=8)),
                        min_size=1, max_size=3),
       keys=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 2**63 - 1)),
                               st.sampled_from([0.5, 0.6, 0.8, 1.0, 1.5])), min_size=3, max_size=3))
def test_trees_over_random_corpora_match_reference(cfg, corpus, prompts, keys):
    """Larger trees than the operation test makes: many stored sequences, budgets up to 24, so
    that deep paths compete with wide ones in the best-first order; requests with noise keys
    (race-aware order) beside requests without."""
    d, ref = make_pair(cfg, 10**6)
    groups = [g for g, _ in corpus]
    d.add_sequences(groups, [s for _, s in corpus])
    ref.add([-1 if g is None else g for g in groups], [s for _, s in corpus])
    ids = list(range(len(prompts)))
    d.start_batch(ids, [p for _, p in prompts], [g for g, _ in prompts])
    ref.start(ids, [-1 if g is None else g for g, _ in prompts], [p for _, p in prompts])
    seeds, temperatures = [k[0] for k in keys[:len(ids)]], [k[1] for k in keys[:len(ids)]]
    d.set_noise_keys(ids, seeds, temperatures, VOCAB)
    ref.set_keys(ids, seeds, temperatures)
    budgets = [cfg.num_draft_tokens] * len(ids)
    assert as_lists(d.propose(ids, budgets)) == ref.propose(ids, budgets)
