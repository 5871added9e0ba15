"""Verifiers and reward functions, run host-side with timeouts and fault isolation.

`math`: final-answer checking for math problems (math-verify in a worker-process sandbox).
`sandbox`: the worker pool with per-call deadlines that verifiers which can hang run in.
`isolation`: one failing sample costs one reward (in process, or in a `sandbox` pool).
"""
