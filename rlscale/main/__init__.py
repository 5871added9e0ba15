"""The commands: one thin absl entry point each, run as `python -m rlscale.main.NAME`.

train               RL (and the sampling demo) from a config; also `python -m rlscale.main`
evaluate            a params checkpoint on its task: pass@k, maj@k, best-of-N, step search
label_steps         Monte-Carlo step labels of a policy's own completions
train_prm           a process reward model on step labels
train_reward_model  a Bradley-Terry reward model on preference pairs
plan                per-device memory and FLOPs of a config on a target mesh, compiled AOT

Each defines its flags in `define_flags(fv, argv)` and runs in `main(fv)` (`rlscale.cli`).
This package imports nothing, so a command can set up JAX's environment before JAX loads.
"""
