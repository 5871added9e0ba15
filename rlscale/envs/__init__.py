"""Environments for multi-turn and tool-integrated RL."""

from rlscale.envs.sandbox import (
    STATUSES,
    ExecResult,
    SandboxError,
    SandboxLimits,
    namespaces_unavailable,
    run_python,
)

__all__ = [
    "STATUSES",
    "ExecResult",
    "SandboxError",
    "SandboxLimits",
    "namespaces_unavailable",
    "run_python",
]
