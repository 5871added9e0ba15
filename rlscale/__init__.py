"""rlscale: a JAX-first research codebase for scaling reinforcement learning of LLMs."""

__version__ = "0.1.0"
