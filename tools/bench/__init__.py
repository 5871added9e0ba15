"""The benchmark sections. `tools/bench.py` runs `decode`, `train`, `generator` and
`episodes` (the values of its `--only`); `tools/gpu_check.py` runs `learner` (the RL update's
MFU), `generator` (the engine's decode against the HBM bandwidth, and its long-tailed
workload) and `attention` (forward + backward), describes the `machine` and writes its files
with `gpu_report`. `common` holds the timing and the measured roofline.

Imported as the package `bench` with `tools/` on `sys.path` (as `python tools/bench.py` has it;
a package wins over the module `bench.py` of the same name beside it).
"""
