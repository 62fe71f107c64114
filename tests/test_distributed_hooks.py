"""The framework hooks over GroupRouter: verl's load-balancer plugin and OpenRLHF's engine choice.

Both are plain Python (no verl/OpenRLHF import), exercised here through the calls the frameworks
make: verl 0.9's RequestLoadBalancer protocol and OpenRLHF 0.11's per-prompt engine indices."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.distributed import GroupRouter, group_key
from rollout_spec.integrations.openrlhf.routing import assign_prompts_to_engines
from rollout_spec.integrations.verl.routing import GroupStickyLoadBalancer


def _servers(n: int) -> dict[str, str]:
    return {f"10.0.0.{i}:8000": f"handle-{i}" for i in range(n)}


def _prompt(i: int) -> list[int]:
    return [1, 2, 3, 100 + i]


def test_verl_balancer_keeps_siblings_and_later_steps_together() -> None:
    lb = GroupStickyLoadBalancer(_servers(4))
    assert lb.require_acquire_fields() == ["prompt_ids"] and lb.require_release_fields() == []
    placed = {}
    for step in range(2):
        for p in range(8):
            sids = {lb.acquire_server(f"s{step}-p{p}-{k}", prompt_ids=_prompt(p))[0] for k in range(4)}
            assert len(sids) == 1  # the n samples of a prompt share a server
            assert placed.setdefault(p, sids.pop()) in lb.get_all_servers()
            if step == 1:
                assert lb.acquire_server(f"s1-p{p}-x", prompt_ids=_prompt(p))[0] == placed[p]  # same as step 0
        for sid in lb.get_all_servers():
            while lb.get_status()["servers"][sid]:
                lb.release_server(sid)
    assert len(set(placed.values())) > 1  # different prompts spread over servers
    ranks = GroupRouter(4).preferences([group_key(_prompt(p)) for p in range(8)], 1)[:, 0]
    assert [lb.get_all_servers()[r] for r in ranks] == [placed[p] for p in range(8)]  # = replica ranks


def test_verl_balancer_bounds_load_and_keeps_multi_turn_requests() -> None:
    lb = GroupStickyLoadBalancer(_servers(4), {"router_class": "x", "load_factor": 1.0, "slack": 2})
    for p in range(40):
        for k in range(4):
            lb.acquire_server(f"p{p}-{k}", prompt_ids=_prompt(p))
    loads = np.array(list(lb.get_status()["servers"].values()))
    assert loads.sum() == 160 and loads.max() <= GroupRouter(4, load_factor=1.0, slack=2).capacity(160)
    first = lb.acquire_server("chat-1", prompt_ids=_prompt(0))[0]
    assert lb.acquire_server("chat-1", prompt_ids=_prompt(0) + [7, 8, 9])[0] == first  # turn 2
    assert lb.get_total_inflight() == 162
    assert lb.clear_sticky_cache()["cleared_entries"] > 0
    with pytest.raises(ValueError, match="prompt_ids"):
        lb.acquire_server("no-prompt")
    with pytest.raises(ValueError, match=r"unknown keys \['load_factr'\]; allowed: .*'max_cache_size', "
                                         r"'seed \(0 only\)'\]"):
        GroupStickyLoadBalancer(_servers(2), {"load_factr": 1.2})
    for seed in (5, "0", True):  # it must match the shared index's
        with pytest.raises(ValueError, match="seed must be 0"):
            GroupStickyLoadBalancer(_servers(2), {"seed": seed})
    assert GroupStickyLoadBalancer(_servers(2), {"seed": 0}).get_all_servers() == list(_servers(2))
    for bad, error in (("10k", TypeError), (None, TypeError), (2.5, TypeError), (True, TypeError),
                       (0, ValueError), (-1, ValueError)):
        with pytest.raises(error, match="router config max_cache_size"):
            GroupStickyLoadBalancer(_servers(2), {"max_cache_size": bad})


def test_verl_balancer_remembers_only_the_most_recent_requests() -> None:
    """``max_cache_size`` bounds the request -> server map: the oldest request is forgotten (a
    later turn of it is a new request and needs its prompt), the newest are still sticky."""
    lb = GroupStickyLoadBalancer(_servers(2), {"max_cache_size": 2})
    first = {rid: lb.acquire_server(rid, prompt_ids=_prompt(p))[0] for p, rid in enumerate("abc")}
    with pytest.raises(ValueError, match="prompt_ids is required to route a new request by its group"):
        lb.acquire_server("a")
    assert lb.acquire_server("b")[0] == first["b"] and lb.acquire_server("c")[0] == first["c"]


def test_verl_balancer_started_empty_takes_a_first_batch_of_several_servers() -> None:
    """verl may build the balancer before its servers and add them all at once: the placeholder
    slot becomes the first and the rest are added, so groups go where a balancer built with the
    same servers sends them."""
    empty = GroupStickyLoadBalancer({})
    empty.add_servers(_servers(3))
    built = GroupStickyLoadBalancer(_servers(3))
    assert empty.get_all_servers() == built.get_all_servers()
    placed = [empty.acquire_server(f"r{p}", prompt_ids=_prompt(p)) for p in range(12)]
    assert placed == [built.acquire_server(f"r{p}", prompt_ids=_prompt(p)) for p in range(12)]
    assert len(set(placed)) > 1  # not all on the placeholder's server


def test_verl_balancer_routes_a_resumed_tail_by_its_first_prompts_group() -> None:
    """After ``clear_sticky_cache`` (verl's fully-async rollouter clears it to rebalance what it
    resumes) a tail, prompt + tokens so far, is a new request to the balancer: it goes where its
    prompt's group goes, the server whose drafter knows the sample, not where its own tokens hash."""
    lb = GroupStickyLoadBalancer(_servers(8))

    def served(request_id: str, prompt_ids: list[int]) -> str:
        sid = lb.acquire_server(request_id, prompt_ids=prompt_ids)[0]
        lb.release_server(sid)  # one at a time: no server is ever too loaded for its group
        return sid

    homes = {p: served(f"s-{p}", _prompt(p)) for p in range(16)}
    assert len(set(homes.values())) > 1
    lb.clear_sticky_cache()
    for p in range(16):
        tails = {served(f"s-{p}-tail{t}", _prompt(p) + [900 + t, 7, 7 + t]) for t in range(4)}
        assert tails == {homes[p]}  # by their own hash, the tails would scatter over the servers
    own = {served(f"fresh-{t}", [4, 4, 900 + t]) for t in range(16)}
    assert len(own) > 1, "prompts extending no earlier prompt keep their own groups"


def test_verl_balancer_follows_removed_and_returning_servers() -> None:
    lb = GroupStickyLoadBalancer(_servers(3))
    home = lb.acquire_server("a", prompt_ids=_prompt(5))[0]
    lb.remove_servers([home])
    moved = lb.acquire_server("b", prompt_ids=_prompt(5))[0]
    assert moved != home and home not in lb.get_all_servers()
    lb.add_servers({home: "handle-back"})
    lb.clear_sticky_cache()
    assert lb.acquire_server("c", prompt_ids=_prompt(5)) == (home, "handle-back")  # its slot, its groups
    lb.add_servers({"10.0.0.9:8000": "handle-9"})
    assert len(lb.get_all_servers()) == 4
    empty = GroupStickyLoadBalancer({})
    with pytest.raises(RuntimeError, match="No available servers"):
        empty.acquire_server("x", prompt_ids=[1])
    empty.add_servers({"s": "h"})
    assert empty.acquire_server("x", prompt_ids=[1]) == ("s", "h")


def test_verl_balancer_keeps_reserved_slots_for_servers_added_later() -> None:
    """A balancer built before its servers (``slots``) gives each its replica rank's slot, so a
    group lands where it would over the full list, whatever order verl adds the servers in."""
    servers = _servers(3)
    full = GroupStickyLoadBalancer(servers)
    later = GroupStickyLoadBalancer({}, {}, list(servers))
    assert later.get_all_servers() == []
    with pytest.raises(RuntimeError, match="No available servers"):
        later.acquire_server("x", prompt_ids=_prompt(0))
    for sid in reversed(list(servers)):
        later.add_servers({sid: servers[sid]})
    assert later.get_all_servers() == list(servers)
    assert [later.acquire_server(f"r{i}", prompt_ids=_prompt(i)) for i in range(12)] == \
           [full.acquire_server(f"r{i}", prompt_ids=_prompt(i)) for i in range(12)]
    with pytest.raises(ValueError, match="slots: each server address once"):
        GroupStickyLoadBalancer({}, {}, ["a", "a"])


def test_verl_balancer_counts_nothing_a_removed_server_held() -> None:
    """verl's separate-async trainer removes servers when it trains and adds them back to roll
    out; what they held in flight is aborted and released while they are out. Their counts start
    again from zero, as in verl's own balancer, instead of weighing on them forever."""
    lb = GroupStickyLoadBalancer(_servers(2))
    placed = [lb.acquire_server(f"r{i}", prompt_ids=_prompt(i))[0] for i in range(40)]
    out = placed[0]
    lb.remove_servers([out])
    for sid in placed:
        lb.release_server(sid)
    lb.add_servers({out: "back"})
    assert lb.get_total_inflight() == 0 and lb.get_status()["servers"] == {sid: 0 for sid in _servers(2)}
    for cycle in range(2):
        held = [lb.acquire_server(f"q{cycle}-{i}", prompt_ids=_prompt(100 + i))[0] for i in range(20)]
        lb.remove_servers([out])
        assert lb.get_total_inflight() == sum(sid != out for sid in held)
        for sid in held:
            lb.release_server(sid)
        lb.add_servers({out: "back"})
        assert lb.get_total_inflight() == 0


def test_openrlhf_engine_choice_is_sticky_and_balanced() -> None:
    prompts = [f"question {i}" for i in range(64)]
    first = assign_prompts_to_engines(prompts, 8, n_samples_per_prompt=8)
    again = assign_prompts_to_engines(prompts[::-1], 8, n_samples_per_prompt=8)[::-1]
    assert first == again  # the same prompt goes to the same engine at every step, in any order
    loads = np.bincount(first, minlength=8) * 8
    assert loads.max() <= GroupRouter(8).capacity(512)
    busy = assign_prompts_to_engines(prompts, 8, 8, pending=[400, 0, 0, 0, 0, 0, 0, 0])
    assert busy.count(0) < first.count(0)  # an engine with a backlog takes fewer new prompts


def test_openrlhf_tokenized_key_matches_the_drafter_group() -> None:
    vocab = {"a": 5, "b": 6}
    tokenize = lambda text: [vocab[c] for c in text]  # noqa: E731
    by_tokens = assign_prompts_to_engines(["ab", "ba"], 4, tokenize=tokenize)
    assert by_tokens == GroupRouter(4).assign([group_key([5, 6]), group_key([6, 5])]).tolist()
    with pytest.raises(ValueError, match="num_engines"):
        assign_prompts_to_engines(["x"], 0)
    with pytest.raises(ValueError, match="replicas"):
        assign_prompts_to_engines(["x"], 3, router=GroupRouter(2))
