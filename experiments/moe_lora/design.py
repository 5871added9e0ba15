"""The MoE/LoRA study's design numbers (protocol.md quotes them): the run-to-run sd measured
from stored data and the seeds per arm the power calculation gives.

    python experiments/moe_lora/design.py

The sd is pooled over the arms of experiments/scalerl_ablations/testbed_seeds.json (end
held-out pass@1 at step 200 of the ladder's size-l testbed in pipeline mode with k = 8, seeds
0-2 of six arms: the testbed of this study, with the ladder's evaluation);
`stats.seeds_per_arm` turns it into seeds per arm for each effect at alpha 0.05 and at Holm's
strictest level alpha / m (m: the tests of the primary family).
"""

import json
import os

from rlscale.scaling import stats

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS_FILE = os.path.join(HERE, "..", "scalerl_ablations", "testbed_seeds.json")
FAMILY = 5  # protocol.md, "Primary family".
# Cross-check: the ladder's three size-l runs (this study's dense arm), end pass@1 at step
# 200, from the "end" column of experiments/ladder/README.md's per-run table (raw runs not
# stored there).
LADDER_L_END = (0.491, 0.490, 0.474)
EFFECTS = (0.015, 0.02, 0.025, 0.03)


def pooled_testbed_sd(path: str = SEEDS_FILE) -> tuple[float, int, int]:
    """(pooled sd, arms, seeds per arm) of the end pass@1 of the testbed's 3-seed arms."""
    with open(path) as f:
        arms = {k: v["end"] for k, v in json.load(f)["arms"].items()}
    return stats.pooled_sd(arms), len(arms), len(next(iter(arms.values())))


def design(family: int = FAMILY, effects=EFFECTS, alpha: float = 0.05) -> dict:
    """{"sd", "arms", "seeds", "seeds_per_arm": {effect: (at alpha, at alpha / family)}}."""
    sd, n_arms, n_seeds = pooled_testbed_sd()
    table = stats.seed_table(sd, effects, alpha=alpha, family=family)
    return {"sd": sd, "arms": n_arms, "seeds": n_seeds, "seeds_per_arm": table}


def main():
    d = design()
    sd_l = stats.pooled_sd({"ladder_l": LADDER_L_END})
    print(
        f"run-to-run sd {d['sd']:.4f} (pooled over {d['arms']} arms x {d['seeds']} seeds, "
        "scalerl_ablations/testbed_seeds.json)"
    )
    for effect, (n, n_holm) in d["seeds_per_arm"].items():
        print(
            f"effect {effect:.3f} (d = {effect / d['sd']:.2f}): {n} seeds per arm at alpha 0.05, "
            f"{n_holm} at 0.05 / {FAMILY} (power 0.8)"
        )
    n = d["seeds_per_arm"][0.02][1]
    print(
        f"cross-check: the ladder's l seeds give sd {sd_l:.4f}; with it, effect 0.02 needs "
        f"{stats.seeds_per_arm(0.02, sd_l, alpha=0.05 / FAMILY)} seeds per arm at 0.05 / "
        f"{FAMILY}, and {n} seeds have power "
        f"{stats.power(n, 0.02, sd_l, alpha=0.05 / FAMILY):.2f}"
    )


if __name__ == "__main__":
    main()
