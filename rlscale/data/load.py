"""A run's task and problems from `config.task`: a synthetic task or local math files."""

import os

from rlscale import chat
from rlscale.data import builders, math_data, tasks


def load_task(config, workdir: str):
    """(task, {split: problems}) for `config.task`, materialized in `workdir/data`.

    Synthetic tasks (`tasks.TASKS`) are generated and materialized by `builders`; `math` reads
    the configured files (`task.files`, `task.format`) with `math_data` and formats the prompts
    with the configured chat template (`task.chat_template`, "" for none).
    """
    t, data_dir = config.task, os.path.join(workdir, "data")
    if t.name in tasks.TASKS:
        task = tasks.get(t.name, t.difficulty, t.seed)
        sources = builders.materialize(
            t.name, t.difficulty, t.n_train, t.n_test, data_dir, seed=t.seed
        )
        return task, {
            split: [builders.decode(src[i]) for i in range(len(src))]
            for split, src in sources.items()
        }
    if t.name == "math":
        template = chat.get(t.chat_template) if t.chat_template else None
        splits = math_data.load(
            dict(t.files),
            t.format,
            data_dir,
            template,
            instruction=t.instruction or None,
            system=t.system or None,
        )
        return math_data.MathTask(), splits
    raise ValueError(
        f"task.name={t.name!r} is not a synthetic task ({', '.join(tasks.TASKS)}) or 'math'"
    )
