"""Stores one finished run of the long-completion testbed as evidence: its evaluation lines
and the per-step length, truncation and interruption metrics of WORKDIR/metrics.jsonl,
compacted by `rlscale.scaling.evidence.store_run` into experiments/long_testbed/runs/NAME.jsonl
(NAME: the workdir's name, ARM_sSEED).

    python experiments/long_testbed/store.py WORKDIR [--runs DIR]
"""

import os

from rlscale.scaling import evidence

HERE = os.path.dirname(os.path.abspath(__file__))
# Per-step keys kept beside the evaluations (protocol.md, "Secondary metrics").
KEEP = r"train/(response_length|truncated_frac|interrupted_frac|pass_rate)"


if __name__ == "__main__":
    evidence.store_main(HERE, KEEP)
