"""Verifiers and reward functions, run host-side with timeouts and fault isolation.

`math`: final-answer grading for math problems (`grade`, run in worker processes; `verify`:
the standalone API with its own sandboxed workers).
`sandbox`: the worker pool with per-call deadlines that verifiers which can hang run in.
`worker`: the pool's processes (fresh interpreters running `worker.main`), which never import
the caller's `__main__`.
`isolation`: one failing sample costs one reward (in process, or in a `sandbox` pool).
"""
