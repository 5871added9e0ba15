"""A run's task and problems from `config.task`: a synthetic task or problem files."""

import os

from rlscale import chat
from rlscale.data import builders, math_data, tasks

# The files task (`math_data.FilesTask`); "math" is its name from when it read math files only.
FILE_TASKS = ("files", "math")


def chat_template(task_config) -> chat.ChatTemplate | None:
    """The chat template a task's prompts are written in (`task.chat_template` of a files
    task), or None."""
    if task_config.name in FILE_TASKS and task_config.chat_template:
        return chat.get(task_config.chat_template)
    return None


def load_task(config, workdir: str):
    """(task, {split: problems}) for `config.task`, materialized in `workdir/data`.

    Synthetic tasks (`tasks.TASKS`) are generated and materialized by `builders`; the files
    task (`files`, or its old name `math`) reads the configured files (`task.files`,
    `task.format`, `task.fields`) with `math_data`, formats the prompts with the configured
    chat template (`task.chat_template`, "" for none) and grades with `task.verifier`.
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
    if t.name in FILE_TASKS:
        splits = math_data.load(
            dict(t.files),
            t.format,
            data_dir,
            chat_template(t),
            fields=t.fields,
            verifier=t.verifier,
            instruction=t.instruction or None,
            system=t.system or None,
        )
        return math_data.FilesTask(t.verifier), splits
    if t.name == "reasoning_gym":
        from rlscale.data import reasoning_gym_tasks  # Imports reasoning-gym: about 2 s.

        return reasoning_gym_tasks.load(t, data_dir)
    raise ValueError(
        f"task.name={t.name!r} is not a synthetic task ({', '.join(tasks.TASKS)}), 'files' "
        "or 'reasoning_gym'"
    )
