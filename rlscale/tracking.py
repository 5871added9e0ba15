"""Experiment tracking beside `metrics.jsonl`: a Weights & Biases run (`config.tracking`,
`TrackingConfig`) that gets every record `metrics.MetricWriter` writes, with the same names
and step axis. Optional: `pip install -e '.[wandb]'`.

The run's id is kept in `WORKDIR/wandb_run.json`, so a resumed run (a new process) continues
the same W&B run. A resumed run writes again the steps after its checkpoint, which the
killed run may already have logged: W&B takes a step only once and in order, so those
records are skipped (they equal what the resumed run computes: a run equals its resume).
Only process 0 writes (`MetricWriter(enabled=...)`).
"""

import dataclasses
import importlib.util
import json
import os
import secrets
import subprocess

from rlscale import sections

RUN_FILE = "wandb_run.json"


@dataclasses.dataclass(frozen=True)
class TrackingConfig(sections.Section):
    """`config.tracking`: `wandb_project` ("" for none) and `wandb_entity` ("": the account's
    default) of the Weights & Biases run; `WANDB_MODE=offline` writes it locally only."""

    wandb_project: str = ""
    wandb_entity: str = ""

    def problems(self) -> list[str]:
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            return [
                f"tracking.wandb_project={self.wandb_project!r} needs the wandb package: "
                "pip install -e '.[wandb]'"
            ]
        return []


def git_commit() -> str | None:
    """The commit of the rlscale checkout this process runs (None outside a git checkout),
    with `-dirty` when its tracked files have changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return described.stdout.strip() or None


class WandbSink:
    """One W&B run of a workdir: `log(step, record)` for each metrics record, `close()`.

    `WORKDIR/wandb_run.json` holds the run's id and the last step logged: a resumed process
    continues that run, and skips the steps it already holds (also offline, where W&B cannot
    say which it has)."""

    def __init__(self, cfg: TrackingConfig, workdir: str, config: dict):
        import wandb

        self.path = os.path.join(workdir, RUN_FILE)
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.state = json.load(f)
        else:
            self.state = {"id": secrets.token_hex(4), "logged_through": -1}  # W&B: [a-z0-9]+.
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            id=self.state["id"],
            resume="allow",
            dir=workdir,
            name=os.path.basename(os.path.normpath(workdir)),
            config={**config, "git_commit": git_commit()},
            settings=wandb.Settings(console="off"),  # Metrics only: the console stays ours.
        )
        self._save()

    def _save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.state, f)
        os.replace(self.path + ".tmp", self.path)

    def log(self, step: int, record: dict) -> None:
        if step <= self.state["logged_through"]:  # Logged before the kill this run resumes.
            return
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)
        self.state["logged_through"] = step
        self._save()

    def close(self) -> None:
        self.run.finish()


def sink(cfg: TrackingConfig, workdir: str, config: dict, enabled: bool) -> WandbSink | None:
    """The run's W&B sink where `tracking.wandb_project` names one and this process writes."""
    return WandbSink(cfg, workdir, config) if cfg.wandb_project and enabled else None
