"""Adapters for RL frameworks and inference servers, installed as ``rollout_spec.integrations``.

Each subpackage imports the framework it adapts lazily, so the core installs without them.
"""
