"""Stores one finished run of the MoE/LoRA study as evidence: the evaluation lines and the
per-step mismatch, routing and staleness metrics of WORKDIR/metrics.jsonl, compacted by
`rlscale.scaling.evidence.store_run` into experiments/moe_lora/runs/NAME.jsonl (NAME: the
workdir's name, ARM_sSEED).

    python experiments/moe_lora/store.py WORKDIR [--runs DIR]
"""

import os

from rlscale.scaling import evidence

HERE = os.path.dirname(os.path.abspath(__file__))
# Per-step keys kept beside the evaluations (protocol.md, "Secondary metrics").
# Router replay's `train/routing_mismatch` and the replay probe's other gap
# (`train/logp_gap_abs_without_replay` or `_with_replay`) among them.
KEEP = (
    r"train/(logp_gap_abs\w*|prob_pearson|trainer_logp_gap|moe_lb|moe_z|pass_rate|\w*rout\w*)"
    r"|pipeline/staleness_(mean|max)"
)


if __name__ == "__main__":
    evidence.store_main(HERE, KEEP)
