"""The native config's initializers are the values the Python facade hands the core by default,
so a reader of csrc/core_config.h (or a C++ caller) sees the defaults that actually run."""
from rollout_spec import _core
from rollout_spec.config import SpecConfig
from rollout_spec.drafter import _core_config

FIELDS = ("num_draft_tokens", "max_batch_draft_tokens", "max_depth", "max_match_len", "min_match_len",
          "min_token_prob", "tree", "adaptive_budget", "history_steps", "capacity_tokens", "max_occurrences",
          "global_max_occurrences", "chain_walk", "global_unigram_walk", "enough_occurrences", "match_power",
          "evidence_discount", "propose_threads", "scope_weights")


def test_core_config_initializers_match_what_the_drafter_sets_by_default() -> None:
    native, handed = _core.CoreConfig(), _core_config(SpecConfig())
    differ = {f: (getattr(native, f), getattr(handed, f)) for f in FIELDS if getattr(native, f) != getattr(handed, f)}
    assert not differ, f"csrc/core_config.h initializer vs the drafter's default (field: (header, drafter)): {differ}"


def test_the_drafter_sets_the_scope_weights_it_is_given() -> None:
    assert _core_config(SpecConfig(request_weight=2.0, group_weight=0.25, global_weight=0.0)).scope_weights == (
        2.0, 0.25, 0.0)
