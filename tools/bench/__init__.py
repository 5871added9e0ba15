"""The sections of `tools/bench.py`, one module each (`decode`, `train`, `generator`,
`episodes`: the values of its `--only`), and what they share (`common`: timing and this
machine's measured roofline). `tools/gpu_check.py` reuses them.

Imported as the package `bench` with `tools/` on `sys.path` (as `python tools/bench.py` has it;
a package wins over the module `bench.py` of the same name beside it).
"""
