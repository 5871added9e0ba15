"""Stores one finished run of the off-policy study as evidence: the evaluation lines and the
per-step mismatch, masking and staleness metrics of WORKDIR/metrics.jsonl, compacted by
`rlscale.scaling.evidence` into experiments/off_policy/runs/NAME.jsonl (NAME: the workdir's
name, ARM_sSEED).

    python experiments/off_policy/store.py WORKDIR [--runs DIR]
"""

import argparse
import json
import os
import re

from rlscale.scaling import evidence

HERE = os.path.dirname(os.path.abspath(__file__))
# Per-step keys kept beside the evaluations (protocol.md, "Secondary metrics").
KEEP = re.compile(
    r"train/(logp_gap_abs|prob_pearson|trainer_logp_gap|\w+_masked_(tokens|seqs)"
    r"|k3_rejection_kl|m2po_m2|masked_is_weight_mean|rollout_kl|pass_rate)"
    r"|pipeline/staleness_(mean|max)"
)


def kept_keys(metrics_path: str, pattern=KEEP) -> tuple[str, ...]:
    """The keys of `metrics_path` (a metrics.jsonl) that `pattern` matches in full, sorted."""
    keys = set()
    with open(metrics_path) as f:
        for line in f:
            if line.strip():
                keys.update(k for k in json.loads(line) if pattern.fullmatch(k))
    return tuple(sorted(keys))


def store(workdir: str, runs_dir: str, pattern=KEEP) -> str:
    """Writes RUNS_DIR/NAME.jsonl from `workdir`; returns its path."""
    keep = kept_keys(os.path.join(workdir, "metrics.jsonl"), pattern)
    meta, lines = evidence.compact_run(workdir, keep=keep)
    path = os.path.join(runs_dir, f"{meta['run']}.jsonl")
    evidence.write_run(path, meta, lines)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--runs", default=os.path.join(HERE, "runs"))
    args = parser.parse_args(argv)
    print(f"stored {store(args.workdir, args.runs)}")


if __name__ == "__main__":
    main()
