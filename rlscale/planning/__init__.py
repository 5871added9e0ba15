"""Planning a run before launching it (`python -m rlscale.main.plan`): what each device of a
target mesh holds and computes in one RL step, from the run's programs compiled ahead of time
on abstract arrays (`planner`), the checks of what a plan is asked for (`inputs`), and what a
plan says against an accelerator: the table, the verdict on a memory budget, the knobs to
turn and the step-time bound (`report`)."""
