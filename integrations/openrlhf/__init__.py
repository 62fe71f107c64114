"""rollout-spec in OpenRLHF: ``--rollout_spec`` on OpenRLHF's PPO launcher.

Run ``python -m rollout_spec.integrations.openrlhf.train_ppo_ray --rollout_spec ...`` with
OpenRLHF's usual arguments; every vLLM engine then drafts with rollout-spec's proposer, the
drafters are refreshed after each weight broadcast, and acceptance is logged as
``train/rollout/spec_*``. OpenRLHF, Ray and vLLM are imported only when the hooks are installed.
"""
