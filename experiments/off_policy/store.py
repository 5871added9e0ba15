"""Stores one finished run of the off-policy study as evidence: the evaluation lines and the
per-step mismatch, masking and staleness metrics of WORKDIR/metrics.jsonl, compacted by
`rlscale.scaling.evidence.store_run` into experiments/off_policy/runs/NAME.jsonl (NAME: the
workdir's name, ARM_sSEED).

    python experiments/off_policy/store.py WORKDIR [--runs DIR]
"""

import os

from rlscale.scaling import evidence

HERE = os.path.dirname(os.path.abspath(__file__))
# Per-step keys kept beside the evaluations (protocol.md, "Secondary metrics").
KEEP = (
    r"train/(logp_gap_abs|prob_pearson|trainer_logp_gap|\w+_masked_(tokens|seqs)"
    r"|k3_rejection_kl|m2po_m2|masked_is_weight_mean|rollout_kl|pass_rate)"
    r"|pipeline/staleness_(mean|max)"
)


if __name__ == "__main__":
    evidence.store_main(HERE, KEEP)
