"""Stores one finished run of the iso-compute study as evidence: its evaluation lines (step
0, M / 2, M) and the per-step training pass rate of WORKDIR/metrics.jsonl, compacted by
`rlscale.scaling.evidence.store_run` into experiments/iso_compute_v2/runs/NAME.jsonl (NAME:
the workdir's name, `C{C}__n{n}__B{B_p}__M{M}__seed_{S}`, as `tools/sweep.py` names it).

    python experiments/iso_compute_v2/store.py WORKDIR [--runs DIR]
"""

import os

from rlscale.scaling import evidence

HERE = os.path.dirname(os.path.abspath(__file__))
KEEP = r"train/pass_rate"

if __name__ == "__main__":
    evidence.store_main(HERE, KEEP)
