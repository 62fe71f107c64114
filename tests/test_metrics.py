"""SpecStats figures, verl-named wandb panels, sinks and the PNG dashboard."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from rollout_spec import metrics
from rollout_spec.metrics import SpecStats, stats_from_outputs, wandb_metrics


@dataclass
class Out:
    token_ids: list
    num_verify_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    extra: dict = field(default_factory=dict)

    def __getattr__(self, name):
        try:
            return self.__dict__["extra"][name]
        except KeyError:
            raise AttributeError(name) from None


def _outputs():
    return [Out(list(range(12)), 4, 16, 8), Out(list(range(6)), 6, 8, 0)]


def test_figures_follow_design_definitions():
    base = [Out(list(range(12)), 12, 0, 0), Out(list(range(6)), 6, 0, 0)]
    s = stats_from_outputs(0, _outputs(), 2.0, draft_budget=8, base_outputs=base, base_seconds=3.0,
                           rewards=[1.0, 0.0])
    assert s.spec_tokens == 18 and s.verify_steps == 10
    assert s.tpf == pytest.approx(1.8)
    assert s.accept_rate == pytest.approx(8 / 24)
    assert s.speedup == pytest.approx((18 / 2.0) / (18 / 3.0))
    assert s.budget_used == pytest.approx(24 / 80)
    assert s.mean_reward == 0.5
    # verl's per-sample means, not pooled ratios
    assert s.verl_accept_rate == pytest.approx((8 / 16 + 0 / 8) / 2)
    assert s.verl_accept_length == pytest.approx(((1 + 8 / 4) + (1 + 0)) / 2)
    assert s.same_samples == 2 and s.same_rate == 1.0 and wandb_metrics(s)["spec/same_samples"] == 1.0
    base[1].token_ids = [0, 1, 2, 9]  # the baseline drew another second sample
    other = stats_from_outputs(0, _outputs(), 2.0, draft_budget=8, base_outputs=base, base_seconds=3.0)
    assert other.same_samples == 1 and other.same_rate == 0.5


def test_panels_use_verl_names_and_skip_unmeasured():
    s = stats_from_outputs(3, _outputs(), 1.0, draft_budget=8)
    m = wandb_metrics(s)
    assert m["rollout/spec_accept_rate"] == s.verl_accept_rate
    assert m["rollout/spec_accept_length"] == s.verl_accept_length
    assert m["spec/tpf"] == s.tpf
    assert "spec/speedup" not in m and "critic/score/mean" not in m and "spec/same_samples" not in m
    assert not any(k.startswith("spec/accept_by_depth") for k in m)


def test_depth_counters_summed_when_engine_reports_them():
    outs = _outputs()
    outs[0].extra = {"num_drafted_by_depth": [4, 3, 1], "num_accepted_by_depth": [3, 1, 0]}
    outs[1].extra = {"num_drafted_by_depth": [2], "num_accepted_by_depth": [1]}
    s = stats_from_outputs(0, outs, 1.0, draft_budget=8,
                           drafter={"us_per_request": 12.5, "index_tokens": 100, "index_bytes": 4000})
    assert s.depth_drafted == (6, 3, 1) and s.depth_accepted == (4, 1, 0)
    assert s.accept_by_depth == pytest.approx([4 / 6, 1 / 3, 0.0])
    m = wandb_metrics(s)
    assert m["spec/accept_by_depth/2"] == pytest.approx(1 / 3)
    assert m["spec/drafter_us_per_request"] == 12.5 and m["spec/index_bytes"] == 4000


def test_nothing_drafted_is_left_out_not_logged_as_zero(tmp_path):
    plain = [Out(list(range(12)), 12, 0, 0), Out(list(range(6)), 6, 0, 0)]
    s = stats_from_outputs(0, plain, 1.0, draft_budget=0)
    assert s.accept_rate is None and s.budget_used is None
    m = wandb_metrics(s)
    assert "spec/accept_rate" not in m and "spec/draft_budget_used" not in m
    assert m["rollout/spec_accept_rate"] == 0.0  # verl's own rule: a request without drafts is 0
    assert metrics.pooled([s])["accept_rate"] is None
    # a depth no draft reached has no acceptance; a depth reached and never accepted has 0
    outs = _outputs()
    outs[0].extra = {"num_drafted_by_depth": [4, 0, 1], "num_accepted_by_depth": [3, 0, 0]}
    outs[1].extra = {"num_drafted_by_depth": [2], "num_accepted_by_depth": [1]}
    deep = stats_from_outputs(1, outs, 1.0, draft_budget=8)
    assert deep.accept_by_depth == [pytest.approx(4 / 6), None, 0.0]
    m = wandb_metrics(deep)
    assert "spec/accept_by_depth/2" not in m and m["spec/accept_by_depth/3"] == 0.0
    assert metrics.pooled([s, deep])["accept_rate"] == pytest.approx(8 / 24)
    path = metrics.plot_dashboard([s, deep], tmp_path / "mixed.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pooled_speedup_uses_only_steps_with_baseline():
    a = SpecStats(0, 1, 100, 1.0, 50, 10, 5, 0.5, 2.0, 8, base_tokens=100, base_seconds=2.0)
    b = SpecStats(1, 1, 100, 4.0, 50, 10, 5, 0.5, 2.0, 8)
    total = metrics.pooled([a, b])
    assert total["speedup"] == pytest.approx(2.0)
    assert total["tpf"] == pytest.approx(2.0)


def test_a_step_without_samples_is_refused_not_logged_as_zeros():
    """verl's compute_spec_decode_metrics logs nothing for an empty batch; ours logged 0.0
    under its two names (and a TPF and throughput of 0)."""
    with pytest.raises(ValueError, match="spec_outputs must hold at least one output"):
        stats_from_outputs(0, [], 1.0, draft_budget=8)


def test_speedup_not_reported_when_the_speculative_pass_was_not_timed():
    """A baseline of 0 s already gave no speedup; a speculative pass of 0 s gave 0.0x."""
    untimed = SpecStats(0, 1, 100, 0.0, 50, 10, 5, 0.5, 2.0, 8, base_tokens=100, base_seconds=2.0)
    assert untimed.speedup is None and "spec/speedup" not in wandb_metrics(untimed)
    assert metrics.pooled([untimed])["speedup"] is None


def test_wandb_mode_resolution(monkeypatch):
    monkeypatch.setattr(metrics, "wandb_available", lambda: False)
    assert metrics.resolve_wandb_mode(None) == "disabled"
    with pytest.raises(ValueError, match="needs the wandb package"):
        metrics.resolve_wandb_mode("offline")
    with pytest.raises(ValueError, match="must be one of"):
        metrics.resolve_wandb_mode("sometimes")
    monkeypatch.setattr(metrics, "wandb_available", lambda: True)
    assert metrics.resolve_wandb_mode(None) == "offline"
    assert isinstance(metrics.make_sink("disabled", "p", {}), metrics.NullSink)


def test_wandb_online_without_credentials_is_refused_up_front(monkeypatch):
    """Online mode with no API key failed at wandb.init, after the model had loaded, with a
    wandb UsageError traceback; it is refused while the arguments are checked."""
    monkeypatch.setattr(metrics, "wandb_available", lambda: True)
    logins = []

    def login(prompt=True, verify=True):
        logins.append((prompt, verify))
        return has_key

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(login=login))
    has_key = False
    with pytest.raises(ValueError, match="'online' needs a W&B API key"):
        metrics.resolve_wandb_mode("online")
    assert logins == [(False, False)]  # no prompt, no network
    assert metrics.resolve_wandb_mode("offline") == "offline"  # offline needs no key
    has_key = True
    assert metrics.resolve_wandb_mode("online") == "online"


def test_wandb_credentials_on_wandb_without_login_prompt(monkeypatch):
    def old_login(verify=True):  # wandb before login(prompt=...)
        raise AssertionError("an old login would prompt")

    api = types.SimpleNamespace(api_key=None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(login=old_login, api=api))
    assert not metrics.wandb_credentials_found()
    api.api_key = "k" * 40
    assert metrics.wandb_credentials_found()


def test_wandb_sink_logs_through_wandb_api(monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, dict(data)))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["mode"], kwargs["project"]))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    sink = metrics.make_sink("offline", "rollout-spec", {"n": 4})
    s = stats_from_outputs(1, _outputs(), 1.0, draft_budget=8)
    sink.log(wandb_metrics(s), step=1)
    sink.finish()
    assert calls[0] == ("init", "offline", "rollout-spec")
    assert calls[1][1] == 1 and calls[1][2]["rollout/spec_accept_rate"] == s.verl_accept_rate
    assert calls[-1] == ("finish",)


def test_wandb_sink_refuses_a_mode_that_is_not_a_run_before_importing_wandb(monkeypatch):
    """``make_sink`` takes an already resolved mode: an unresolved one ("auto") or a typo is
    refused by name with the two modes a run has, and wandb.init is never called."""
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: pytest.fail("init")))
    for mode in ("auto", "Offline"):
        with pytest.raises(ValueError, match=rf"wandb mode must be 'offline' or 'online' for WandbSink, "
                                             rf"got '{mode}'"):
            metrics.make_sink(mode, "rollout-spec", {})


def test_dashboard_png_written(tmp_path):
    outs = _outputs()
    outs[0].extra = {"num_drafted_by_depth": [4, 3], "num_accepted_by_depth": [3, 1]}
    outs[1].extra = {"num_drafted_by_depth": [2], "num_accepted_by_depth": [1]}
    base = [Out(list(range(12)), 12, 0, 0), Out(list(range(6)), 6, 0, 0)]
    hist = [stats_from_outputs(i, outs, 1.0 + i, draft_budget=8, base_outputs=base, base_seconds=2.0)
            for i in range(3)]
    path = metrics.plot_dashboard(hist, tmp_path / "dash.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="at least one step"):
        metrics.plot_dashboard([], tmp_path / "empty.png")


def test_tables_render():
    from rich.console import Console

    s = stats_from_outputs(0, _outputs(), 1.0, draft_budget=8, rewards=[1.0, 0.0])
    console = Console(record=True, width=140)
    console.print(metrics.step_table(s))
    console.print(metrics.summary_table([s]))
    text = console.export_text()
    assert "1.80" in text and "33.3%" in text and "all" in text


@pytest.mark.parametrize("as_lists", [False, True])
def test_drafter_probe_counts_acceptance_by_depth(as_lists):
    """Over a DraftBatch or the same trees as (tokens, parents) lists, which the engine takes
    too (``tree.drafter_output``)."""
    from rollout_spec.tree import DraftBatch

    class Drafter:
        extended = []

        def propose(self, req_ids, budgets=None):
            if as_lists:
                return [([5, 6, 7], [-1, 0, 1]), ([8, 9, 10], [-1, -1, 0]), ([], [])]
            return DraftBatch.from_lists([[(5, -1), (6, 0), (7, 1)], [(8, -1), (9, -1), (10, 0)], []])

        def extend_batch(self, req_ids, token_lists):
            self.extended.append(list(req_ids))

        def stats(self):
            return {"index_tokens": 3}

    probe = metrics.DrafterProbe(Drafter())
    probe.extend_batch([0, 1], [[1], [2]])  # prefill: nothing proposed yet, nothing counted
    probe.propose([0, 1, 2], [3, 3, 3])
    # request 0 accepts 5, 6 then a bonus; request 1 accepts the second root child 9 (10 hangs
    # under 8); request 2 had no draft
    probe.extend_batch([0, 1, 2], [[5, 6, 99], [9, 4], [3]])
    assert probe.take_depths() == ((2, 2, 1), (2, 1, 0))
    assert probe.take_depths() == ((), ())
    assert probe.stats() == {"index_tokens": 3} and probe.extended == [[0, 1], [0, 1, 2]]
    assert probe.take_seconds() > 0
    assert metrics.tree_depth([-1, 0, -1, 2, 3]) == 3 and metrics.tree_depth([]) == 0
    assert metrics.tree_depth((-1, 0, 1)) == 3
    with pytest.raises(ValueError, match="speculation is off"):
        metrics.DrafterProbe(None)


@pytest.mark.parametrize("parents, error, message", [
    ([0], ValueError, r"parents\[0\] must be in \[-1, -1\], got 0"),
    ([-1, 2, 1], ValueError, r"parents\[1\] must be in \[-1, 0\], got 2"),
    ([-1, 5], ValueError, r"parents\[1\] must be in \[-1, 0\], got 5"),
    ([-2, 0], ValueError, r"parents\[0\] must be in \[-1, -1\], got -2"),
    ([-1, 0.5], TypeError, r"parents\[1\] must be an integer in \[-1, 0\], got float 0.5"),
    ([True], TypeError, r"parents\[0\] must be an integer in \[-1, -1\], got bool True"),
])
def test_tree_depth_refuses_a_parent_outside_the_topological_range(parents, error, message):
    """A parent must precede its node (DraftBatch's contract): another index was an IndexError, a
    parent below -1 counted as the root and a bool indexed node 0 or 1."""
    with pytest.raises(error, match=message):
        metrics.tree_depth(parents)


def test_drafter_probe_passes_background_only_where_the_drafter_indexes_in_background():
    from rollout_spec.config import SpecConfig
    from rollout_spec.drafter import NgramDrafter, indexes_in_background

    class Plain:  # ``extend_batch`` without ``background``
        def extend_batch(self, req_ids, token_lists):
            self.last = list(req_ids)

    plain = metrics.DrafterProbe(Plain())
    assert not indexes_in_background(plain)
    plain.extend_batch([4], [[1]], background=True)  # extended at once, no TypeError
    assert plain.last == [4]

    probe, alone = metrics.DrafterProbe(NgramDrafter(SpecConfig())), NgramDrafter(SpecConfig())
    assert indexes_in_background(probe)
    for d, background in ((probe, True), (alone, False)):
        d.start_batch([1], [[5, 6, 5]])
        d.extend_batch([1], [[6, 5]], background=background)
    assert probe.propose([1]).tokens.tolist() == alone.propose([1]).tokens.tolist() == [6, 5, 6, 5]
