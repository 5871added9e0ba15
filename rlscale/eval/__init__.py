"""Evaluating a saved policy: unbiased estimators (`estimators`: pass@k, maj@k, best-of-N),
the evaluation of a checkpoint on its task (`harness`), test-time scaling curves against the
number of samples (`best_of_n`) and PRM-guided step search (`step_search`)."""
