"""verl integration: one config flag makes verl's SGLang or vLLM rollout servers draft with us.

``actor_rollout_ref.rollout.custom.speculative=rollout_spec`` turns it on and
``actor_rollout_ref.rollout.custom.rollout_spec.<field>`` sets SpecConfig fields. ``plugin.py``
(entry point ``verl.plugins``) routes verl's replicas through ``servers.py``; ``config.py`` and
``metrics.py`` hold the translation and import nothing from verl.
"""
