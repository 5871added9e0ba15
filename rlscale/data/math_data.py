"""Problem files as TFDS array_record datasets (materialized once per contents), their prompts
formatted at read time, and the files task (`FilesTask`) with its verifiers (math, exact, gsm8k,
auto). Rules: docs/data.md.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from rlscale.data import builders, formats, tasks
from rlscale.rewards import math as math_reward
from rlscale.tokenizers import chat

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class MathProblem(tasks.Problem):
    """A problem from a file: the formatted prompt, the gold answer, a demonstration (the
    row's, else the gold in the verifier's format), where it came from, and the name of the
    verifier that grades it (a key of `VERIFIERS`)."""

    source: str = ""
    id: str = ""
    verifier: str = "math"


# ------------------------------------------------------------------------------------------
# Verifiers.
# ------------------------------------------------------------------------------------------

_ANSWER_LINE_RE = re.compile(r"^[ \t]*(?:final[ \t]+)?answer[ \t]*:(.*)$", re.I | re.M)
_GSM8K_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300  # verl's `_SOLUTION_CLIP_CHARS`.


def _final_section(completion: str) -> str | None:
    """The text after the last `</think>`; None for a `<think>` that never ends."""
    if chat.THINK_END in completion:
        return completion.rsplit(chat.THINK_END, 1)[1]
    return None if chat.THINK_START in completion else completion


def exact_answer(completion: str) -> str | None:
    """The `exact` verifier's answer (module docstring), stripped; None when there is none."""
    text = _final_section(completion)
    if text is None:
        return None
    if formats.BOX_RE.search(text):
        answer = formats.boxed_answer(text)  # None for a malformed last box: no answer.
    else:
        lines = _ANSWER_LINE_RE.findall(text)
        answer = lines[-1] if lines else text
    return answer.strip() if answer is not None and answer.strip() else None


def exact(completion: str, gold: str) -> float:
    """1.0 when `exact_answer(completion)` equals the gold (stripped), else 0.0."""
    return float(exact_answer(completion) == gold.strip())


def gsm8k_answer(completion: str) -> str | None:
    """verl's strict GSM8K extraction: the last `#### number`, commas and `$` removed."""
    found = _GSM8K_RE.findall(completion[-_GSM8K_CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k(completion: str, gold: str) -> float:
    """1.0 when `gsm8k_answer(completion)` equals the gold string, else 0.0 (as verl)."""
    return float(gsm8k_answer(completion) == gold)


VERIFIERS = {"math": math_reward.grade, "exact": exact, "gsm8k": gsm8k}
_EXTRACTORS = {"math": math_reward.extract_answer, "exact": exact_answer, "gsm8k": gsm8k_answer}
VERIFIER_NAMES = ("auto", *VERIFIERS)
# verl's `default_compute_score` rules for data sources whose answers are not graded as math.
DATA_SOURCE_VERIFIERS = {"openai/gsm8k": "gsm8k"}


def check_verifier(verifier: str) -> None:
    """Raises ValueError naming the known verifiers if `verifier` is not one."""
    if verifier not in VERIFIER_NAMES:
        raise ValueError(
            f"unknown verifier {verifier!r}; verifiers: {', '.join(VERIFIER_NAMES)} (or a "
            "reward function: reward.fn='module:function')"
        )


def row_verifier(verifier: str, data_source: str) -> str:
    """The verifier of one row: `verifier`, or for "auto" its data source's rule (else math)."""
    check_verifier(verifier)
    if verifier != "auto":
        return verifier
    return DATA_SOURCE_VERIFIERS.get(data_source, "math")


def demonstration(gold: str, verifier: str) -> str:
    """A completion that states `gold` in the answer format `verifier` reads."""
    return f"#### {gold}" if verifier == "gsm8k" else f"\\boxed{{{gold}}}"


class FilesTask:
    """The verifier side of a problem file, with the interface of `tasks.Task`.

    `verify(completion, problem)` runs the problem's own verifier (`problem.verifier`, a key
    of `VERIFIERS`) against `problem.answer`: the whole check, in the calling process and with
    no deadline, so that the RL loop's reward pool (`rewards.isolation.verifier_pool`) runs it
    in parallel worker processes with its per-sample timeout. Run untrusted completions
    through such a pool, never in the trainer's process: a hostile answer can keep
    math-verify busy for minutes. `extract_answer` is the task's verifier's answer
    extraction (math's for "auto"), for majority voting.
    """

    name = "files"
    demo_stop = None  # Single-turn demonstrations (`tasks.demo_turns`).

    def __init__(self, verifier: str = "auto"):
        check_verifier(verifier)
        self.verifier = verifier

    def verify(self, completion: str, problem: MathProblem) -> float:
        return VERIFIERS[problem.verifier](completion, problem.answer)

    def extract_answer(self, completion: str) -> str | None:
        return _EXTRACTORS["math" if self.verifier == "auto" else self.verifier](completion)


MathTask = FilesTask  # Its name when it read math files only.


# ------------------------------------------------------------------------------------------
# The TFDS builder.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MathFilesConfig(tfds.core.BuilderConfig):
    # (split, absolute path, layout) triples; a `datasets` directory is resolved to its split.
    files: tuple[tuple[str, str, str], ...] = ()
    fields: tuple[tuple[str, str], ...] = ()  # The `fields` layout's column names.


class MathFiles(tfds.core.GeneratorBasedBuilder):
    """One config per (layouts, fields, files' contents); one split per file."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {
        "1.0.0": "gsm8k, math and polaris files.",
        "2.0.0": "Chat-message prompts, demonstrations, data sources (verl, trl, fields).",
    }
    BUILDER_CONFIGS = [MathFilesConfig(name="default")]

    def _info(self):
        return self.dataset_info_from_configs(
            description="Local problems with gold answers (rlscale.data.math_data).",
            disable_shuffling=True,  # Record i is row i of the file.
            features=tfds.features.FeaturesDict(
                {
                    "prompt": tfds.features.Text(),
                    "messages": tfds.features.Text(),  # JSON; "" for a text prompt.
                    "answer": tfds.features.Text(),
                    "demo": tfds.features.Text(),
                    "data_source": tfds.features.Text(),
                    "source": tfds.features.Text(),
                    "id": tfds.features.Text(),
                    "index": np.int64,
                }
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(split) for split, _, _ in self.builder_config.files}

    def _generate_examples(self, split):
        # `materialize` has just read and validated the files; reading again would be the
        # fallback if the builder were driven by TFDS directly.
        rows = getattr(self, "validated_rows", {}).get(split)
        if rows is None:
            c = self.builder_config
            _, path, fmt = next(f for f in c.files if f[0] == split)
            rows = formats.read_rows(path, fmt, dict(c.fields))
        for i, row in enumerate(rows):
            yield i, {**row, "index": i}


def config_name(files: Sequence[tuple[str, str, str]], fields: formats.Fields) -> str:
    """`{layouts}_{digest}`: the digest covers the splits, layouts, fields and the files'
    bytes, so an edited file gets a new dataset and an unchanged one (anywhere on disk) reuses
    the old."""
    h = hashlib.sha256(json.dumps(dataclasses.astuple(fields)).encode())
    for split, path, fmt in sorted(files):
        h.update(f"\0{split}\0{fmt}\0{formats.digest(path)}".encode())
    layouts = "_".join(sorted({fmt for _, _, fmt in files}))
    return f"{layouts}_{h.hexdigest()[:16]}"


def materialize(
    files: str | Mapping[str, str],
    fmt: str,
    data_dir: str,
    fields: formats.Fields | Mapping | None = None,
) -> dict:
    """Builds the dataset once (reused afterwards) and returns {split: data source}.

    Args:
      files: {split: path} (e.g. {"train": ..., "test": ...}), or one path for split "train".
        A path is a `.jsonl`, `.json` or `.parquet` file or a `datasets` directory (a
        `DatasetDict`'s split named like the key is read).
      fmt: The rows' layout, one of `formats.FORMATS`, or "auto" (detected per file).
      data_dir: Where the array_record files go (e.g. `WORKDIR/data`).
      fields: The `fields` layout's column names ({prompt, answer, demo}).

    Raises:
      FileNotFoundError, ValueError: As `formats.read_rows`, before anything is written.
    """
    if isinstance(files, str | os.PathLike):
        files = {"train": files}
    if not files:
        raise ValueError("no files given")
    fields = formats.Fields.of(fields)
    resolved = []
    for split, path in sorted(files.items()):
        path = os.path.abspath(os.fspath(path))
        problem = formats.check_path(path)
        if problem == "no such file":
            raise FileNotFoundError(f"dataset file not found: {path!r}")
        if problem:
            raise ValueError(f"{path}: {problem}")
        if os.path.isdir(path):
            path = formats.dataset_dir(path, split)
        resolved.append((split, path, formats.resolve_format(path, fmt, fields)))
    config = MathFilesConfig(
        name=config_name(resolved, fields),
        files=tuple(resolved),
        fields=tuple(dataclasses.asdict(fields).items()),
    )
    builder = MathFiles(data_dir=data_dir, config=config, file_format="array_record")
    if not builder.data_path.exists():  # Read and checked before anything is written.
        builder.validated_rows = {
            split: formats.read_rows(path, f, fields) for split, path, f in resolved
        }
    return builders.prepare(builder)


# ------------------------------------------------------------------------------------------
# Reading back, with the prompt formatted.
# ------------------------------------------------------------------------------------------


def format_prompt(
    question: str,
    template: chat.ChatTemplate | None = None,
    *,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
    **options,
) -> str:
    """The prompt for a question: `{question}\\n{instruction}` as the user message.

    Args:
      question: The problem text.
      template: A chat template (`chat.get(family)`); None gives the bare user text, for
        base models prompted without a chat format.
      instruction: Appended to the question on its own line; None or "" appends nothing.
      system: An optional system message (ignored without a template).
      **options: Passed to the template (e.g. `enable_thinking=False` for qwen3).
    """
    user = f"{question}\n{instruction}" if instruction else question
    if template is None:
        return user
    return template.prompt(user, system=system, **options)


def format_messages(
    messages: Sequence[chat.Message],
    template: chat.ChatTemplate | None,
    *,
    system: str | None = None,
    **options,
) -> str:
    """The prompt for a chat prompt: `messages` rendered by `template`, as written.

    `system` is prepended only when the conversation has no system message of its own.

    Raises:
      ValueError: Without a template (a chat prompt needs the model's chat format), or when
        the template rejects the conversation.
    """
    if template is None:
        raise ValueError(
            "the prompt is a list of chat messages, but no chat template was given to render "
            "it (task.chat_template is empty: set it to the model's family, one of "
            f"{', '.join(chat.TEMPLATES)}; a model without a chat template needs text prompts)"
        )
    messages = list(messages)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return template(messages, **options)


def problems(
    source: Sequence[dict],
    template: chat.ChatTemplate | None = None,
    *,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
    verifier: str = "auto",
    **options,
) -> list[MathProblem]:
    """Reads one split's data source into problems whose prompts are formatted for `template`.

    Args:
      source: A data source `materialize` returned.
      template, instruction, system, **options: As `format_prompt` (a chat prompt:
        `format_messages`).
      verifier: A key of `VERIFIERS`, or "auto" (by each row's data source: `row_verifier`).

    Raises:
      ValueError: For a chat prompt that cannot be rendered, naming the file and row.
    """
    check_verifier(verifier)
    out = []
    for i in range(len(source)):
        r = builders.text_fields(source[i])
        try:
            if r["messages"]:
                prompt = format_messages(
                    json.loads(r["messages"]), template, system=system, **options
                )
            else:
                prompt = format_prompt(
                    r["prompt"], template, instruction=instruction, system=system, **options
                )
        except ValueError as e:
            raise ValueError(f"{r['source']}: {e}") from None
        v = row_verifier(verifier, r["data_source"])
        out.append(
            MathProblem(
                prompt=prompt,
                answer=r["answer"],
                demo=r["demo"] or demonstration(r["answer"], v),
                source=r["source"],
                id=r["id"],
                verifier=v,
            )
        )
    return out


def load(
    files: str | Mapping[str, str],
    fmt: str,
    data_dir: str,
    template: chat.ChatTemplate | None = None,
    *,
    fields: formats.Fields | Mapping | None = None,
    verifier: str = "auto",
    **prompt_options,
) -> dict[str, list[MathProblem]]:
    """`materialize` then `problems` for every split: {split: [MathProblem]}.

    `prompt_options` are `format_prompt`'s keyword arguments (instruction, system, ...).
    """
    check_verifier(verifier)
    sources = materialize(files, fmt, data_dir, fields)
    return {
        split: problems(src, template, verifier=verifier, **prompt_options)
        for split, src in sources.items()
    }
