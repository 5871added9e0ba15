"""A run's task and problems from `config.task`: a synthetic task or problem files."""

import os

from rlscale import hub
from rlscale.data import builders, formats, math_data, tasks
from rlscale.tokenizers import chat

# The files task (`math_data.FilesTask`); "math" is its name from when it read math files only.
FILE_TASKS = ("files", "math")
# The files task's keys, which may name a file in a Hugging Face Hub repository
# (`hf://datasets/org/name/path`: `hub`), resolved by the config's resolve.
HUB_PATHS = {f"task.files.{split}": hub.FILE for split in ("train", "test")}


def chat_template(task_config) -> chat.ChatTemplate | None:
    """The chat template a task's prompts are written in (`task.chat_template` of a files
    task), or None."""
    if task_config.name in FILE_TASKS and task_config.chat_template:
        return chat.get(task_config.chat_template)
    return None


def load_task(t, workdir: str):
    """(task, {split: problems}) for the task section `t` (`config.task`), materialized in
    `workdir/data`.

    Synthetic tasks (`tasks.TASKS`) are generated and materialized by `builders`; the files
    task (`files`, or its old name `math`) reads the configured files (`task.files`,
    `task.format`, `task.fields`) with `math_data`, formats the prompts with the configured
    chat template (`task.chat_template`, "" for none) and grades with `task.verifier`.
    """
    data_dir = os.path.join(workdir, "data")
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


def task_problems(t) -> list[str]:
    """`config.task`'s problems: its name, and the settings of a files or reasoning-gym task
    (the files' rows are checked when read)."""
    problems = []
    if t.name not in (*tasks.TASKS, *FILE_TASKS, "reasoning_gym"):
        problems.append(
            f"task.name={t.name!r} is not one of {sorted(tasks.TASKS)}, 'files' or 'reasoning_gym'"
        )
    if t.name in FILE_TASKS:
        problems += _files_task_problems(t)
    if t.name == "reasoning_gym":
        from rlscale.data import reasoning_gym_tasks  # Imports reasoning-gym: about 2 s.

        problems += reasoning_gym_tasks.config_problems(t)
    return problems


def _files_task_problems(t) -> list[str]:
    """The files task's keys (`config_lib.files_task`); the rows are checked when read."""
    problems = []
    for split in ("train", "test"):
        path = t.files.get(split, "")
        if not path:
            problems.append(
                f"task.files.{split} is not set (a .jsonl, .json or .parquet file, or a "
                "Hugging Face datasets directory)"
            )
            continue
        trouble = formats.check_path(path)
        if not trouble and os.path.isdir(path):
            try:
                formats.dataset_dir(path, split)
            except ValueError as e:
                trouble = str(e)
        if trouble:
            problems.append(f"task.files.{split}={path!r}: {trouble}")
    if t.format not in ("auto", *formats.FORMATS):
        problems.append(f"task.format={t.format!r} is not one of {('auto', *formats.FORMATS)}")
    named = [k for k in ("prompt", "answer", "demo") if t.fields[k]]
    if named and t.format not in ("auto", "fields"):
        problems.append(
            f"task.fields.{named[0]} is only read with task.format='fields' or 'auto' "
            f"(task.format={t.format!r})"
        )
    elif (named or t.format == "fields") and not (t.fields.prompt and t.fields.answer):
        problems.append(
            "task.fields.prompt and task.fields.answer must both name a column "
            f"(prompt={t.fields.prompt!r}, answer={t.fields.answer!r})"
        )
    if t.verifier not in math_data.VERIFIER_NAMES:
        problems.append(
            f"task.verifier={t.verifier!r} is not a verifier: one of {math_data.VERIFIER_NAMES} "
            "(any other reward: reward.fn='module:function')"
        )
    if t.chat_template and t.chat_template not in chat.TEMPLATES:
        problems.append(
            f"task.chat_template={t.chat_template!r} is not one of {tuple(chat.TEMPLATES)} "
            "(or '' for text prompts)"
        )
    return problems
