"""Local math datasets (GSM8K, MATH and Polaris style files) as TFDS array_record datasets.

The user passes the files; nothing is downloaded. Three row formats, in JSON lines (`.jsonl`)
or Parquet (`.parquet`) files:

  gsm8k    {"question": ..., "answer": "... #### 42"}: the gold is the text after the last
           `####`, stripped, with thousands commas removed (as OpenAI's GSM8K reference code
           does).
  math     {"problem": ..., "solution": "... \\boxed{...} ..."[, "answer": ...]}: the gold is
           the `answer` field when the row has one (MATH-500 style), else the brace-matched
           argument of the solution's last `\\boxed{}` (or `\\fbox{}`, or `\\boxed 5`).
  polaris  {"problem": ..., "answer": ...}.

Each row becomes a record {prompt (the raw question), answer (the gold string), source
(`file:line` for JSON lines, `file:row` with the 0-based row index for Parquet), id (the row's
own `unique_id` or `id` field, else "")}. A malformed row (bad JSON, not an object, a missing
or empty field, no extractable gold) is a ValueError naming the file and the line (or row).

    sources = math_data.materialize({"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
                                    "gsm8k", data_dir=WORKDIR + "/data")
    problems = math_data.problems(sources["test"], chat.get("qwen2.5"))
    problems[0].prompt   # the chat-formatted prompt, ending with the assistant header
    problems[0].answer   # "18"

The dataset is built once per (format, files' contents) and reused afterwards. Prompts are
formatted at read time (`format_prompt`), so one materialized dataset serves every chat
template and instruction.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from rlscale import chat
from rlscale.data import tasks
from rlscale.rewards import math as math_reward

FORMATS = ("gsm8k", "math", "polaris")
EXTENSIONS = (".jsonl", ".parquet")
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ID_FIELDS = ("unique_id", "id")


@dataclasses.dataclass(frozen=True)
class MathProblem(tasks.Problem):
    """A math problem: the formatted prompt, the gold answer, where it came from.

    `demo` (from `tasks.Problem`) is empty: these datasets carry no worked completion in the
    reasoning format.
    """

    source: str = ""
    id: str = ""


# ------------------------------------------------------------------------------------------
# Gold answers.
# ------------------------------------------------------------------------------------------


def gsm8k_gold(answer: str) -> str | None:
    """The text after the last `####`, stripped and without commas; None if there is none."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def boxed_answer(solution: str) -> str | None:
    """The argument of the last `\\boxed{...}` or `\\fbox{...}` in a solution, brace-matched.

    The unbraced form `\\boxed 5` (a few MATH solutions) gives the text after the space up to
    the next `$` or line end, as Hendrycks et al.'s `last_boxed_only_string` does. Returns None
    when there is no box or the last one is malformed (an earlier box is never used instead).
    """
    boxes = list(_BOX_RE.finditer(solution))
    if not boxes:
        return None
    i = boxes[-1].end()
    rest = solution[i:]
    if rest.startswith(" ") and not rest.lstrip(" \t").startswith("{"):
        return rest.split("$", 1)[0].split("\n", 1)[0].strip() or None
    while i < len(solution) and solution[i] in " \t":
        i += 1
    if i >= len(solution) or solution[i] != "{":
        return None
    return math_reward.braced_argument(solution, i)


# ------------------------------------------------------------------------------------------
# Reading and validating files.
# ------------------------------------------------------------------------------------------


def _text_field(record: dict, field: str, *, numbers: bool = False) -> str:
    if field not in record or record[field] is None:
        raise ValueError(f"missing field {field!r}")
    value = record[field]
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"field {field!r} is empty")
    return value


def _parse_record(record, fmt: str) -> tuple[str, str]:
    """(question, gold) of one row; ValueError says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"a row must be a JSON object, got {type(record).__name__}")
    if fmt == "gsm8k":
        question = _text_field(record, "question")
        gold = gsm8k_gold(_text_field(record, "answer"))
        if gold is None:
            raise ValueError("field 'answer' has no '####' before the final answer")
    elif fmt == "math":
        question = _text_field(record, "problem")
        if record.get("answer") is not None:
            gold = _text_field(record, "answer", numbers=True).strip()
        else:
            gold = boxed_answer(_text_field(record, "solution"))
            if gold is None:
                raise ValueError(
                    "field 'solution' has no \\boxed{...} answer (or its last box is unbalanced)"
                )
    elif fmt == "polaris":
        question = _text_field(record, "problem")
        gold = _text_field(record, "answer", numbers=True).strip()
    else:
        raise ValueError(f"unknown math dataset format {fmt!r}; formats: {', '.join(FORMATS)}")
    if not gold.strip():
        raise ValueError("the gold answer is empty")
    return question, gold


def _row_id(record: dict) -> str:
    for field in _ID_FIELDS:
        if record.get(field) is not None:
            return str(record[field])
    return ""


def _records(path: str):
    """Yields (where, source, record) for each row of a `.jsonl` or `.parquet` file.

    `where` names the row in error messages, `source` is its short id, and `record` is the
    parsed row or, for a line that is not JSON, the ValueError to report.
    """
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # Blank lines (a trailing one, say) hold no row.
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    record = ValueError(f"not UTF-8: {e}")
                except json.JSONDecodeError as e:
                    record = ValueError(f"bad JSON: {e}")
                yield f"line {line_no}", f"{os.path.basename(path)}:{line_no}", record
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq  # A dependency of tensorflow-datasets.

        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"row index {i}", f"{os.path.basename(path)}:row{i}", record
    else:
        raise ValueError(f"{path!r}: unsupported file type; expected one of {EXTENSIONS}")


def read_rows(path: str, fmt: str) -> list[dict]:
    """Reads and validates a file: [{prompt, answer, source, id}], in file order.

    Args:
      path: A `.jsonl` or `.parquet` file.
      fmt: One of `FORMATS`.

    Raises:
      FileNotFoundError: If `path` does not exist.
      ValueError: On an unknown format or file type, an empty file, or a malformed row,
        naming the file and the 1-based line (JSON lines) or 0-based row index (Parquet).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown math dataset format {fmt!r}; formats: {', '.join(FORMATS)}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"math dataset file not found: {path!r}")
    rows = []
    for where, source, record in _records(path):
        try:
            if isinstance(record, ValueError):
                raise record
            question, gold = _parse_record(record, fmt)
        except ValueError as e:
            raise ValueError(f"{path}, {where}: {e}") from None
        rows.append({"prompt": question, "answer": gold, "source": source, "id": _row_id(record)})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


# ------------------------------------------------------------------------------------------
# The TFDS builder.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MathFilesConfig(tfds.core.BuilderConfig):
    format: str = "math"
    files: tuple[tuple[str, str], ...] = ()  # (split, absolute path) pairs.


class MathFiles(tfds.core.GeneratorBasedBuilder):
    """One config per (format, files' contents); one split per file."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [MathFilesConfig(name="default")]

    def _info(self):
        return self.dataset_info_from_configs(
            description="Local math problems with gold answers (rlscale.data.math_data).",
            disable_shuffling=True,  # Record i is row i of the file.
            features=tfds.features.FeaturesDict(
                {
                    "prompt": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "source": tfds.features.Text(),
                    "id": tfds.features.Text(),
                    "index": np.int64,
                }
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(split) for split, _ in self.builder_config.files}

    def _generate_examples(self, split):
        # `materialize` has just read and validated the files; reading again would be the
        # fallback if the builder were driven by TFDS directly.
        rows = getattr(self, "validated_rows", {}).get(split)
        if rows is None:
            path = dict(self.builder_config.files)[split]
            rows = read_rows(path, self.builder_config.format)
        for i, row in enumerate(rows):
            yield i, {**row, "index": i}


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def config_name(fmt: str, files: Mapping[str, str]) -> str:
    """`{format}_{digest}`: the digest covers the splits and the files' bytes, so an edited
    file gets a new dataset and an unchanged one (anywhere on disk) reuses the old."""
    h = hashlib.sha256(fmt.encode())
    for split in sorted(files):
        h.update(f"\0{split}\0{_file_digest(files[split])}".encode())
    return f"{fmt}_{h.hexdigest()[:16]}"


def materialize(files: str | Mapping[str, str], fmt: str, data_dir: str) -> dict:
    """Builds the dataset once (reused afterwards) and returns {split: data source}.

    Args:
      files: {split: path} (e.g. {"train": ..., "test": ...}), or one path for split "train".
      fmt: The rows' format, one of `FORMATS`.
      data_dir: Where the array_record files go (e.g. `WORKDIR/data`).

    Raises:
      FileNotFoundError, ValueError: As `read_rows`, before anything is written.
    """
    if isinstance(files, str | os.PathLike):
        files = {"train": files}
    if not files:
        raise ValueError("no files given")
    if fmt not in FORMATS:
        raise ValueError(f"unknown math dataset format {fmt!r}; formats: {', '.join(FORMATS)}")
    files = {split: os.path.abspath(os.fspath(path)) for split, path in files.items()}
    for path in files.values():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"math dataset file not found: {path!r}")
    config = MathFilesConfig(
        name=config_name(fmt, files), format=fmt, files=tuple(sorted(files.items()))
    )
    builder = MathFiles(data_dir=data_dir, config=config, file_format="array_record")
    if not builder.is_prepared():
        builder.validated_rows = {split: read_rows(path, fmt) for split, path in files.items()}
        builder.download_and_prepare()
    return builder.as_data_source()


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


def decode(example: dict) -> dict:
    """A data-source record with its text fields as `str`."""
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in example.items()}


def problems(
    source: Sequence[dict],
    template: chat.ChatTemplate | None = None,
    *,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
    **options,
) -> list[MathProblem]:
    """Reads one split's data source into problems whose prompts are formatted for `template`.

    The arguments after `source` are `format_prompt`'s.
    """
    out = []
    for i in range(len(source)):
        r = decode(source[i])
        prompt = format_prompt(
            r["prompt"], template, instruction=instruction, system=system, **options
        )
        out.append(
            MathProblem(prompt=prompt, answer=r["answer"], demo="", source=r["source"], id=r["id"])
        )
    return out


def load(
    files: str | Mapping[str, str],
    fmt: str,
    data_dir: str,
    template: chat.ChatTemplate | None = None,
    **prompt_options,
) -> dict[str, list[MathProblem]]:
    """`materialize` then `problems` for every split: {split: [MathProblem]}.

    `prompt_options` are `format_prompt`'s keyword arguments (instruction, system, ...).
    """
    sources = materialize(files, fmt, data_dir)
    return {split: problems(src, template, **prompt_options) for split, src in sources.items()}


# ------------------------------------------------------------------------------------------
# The task: verification with the math verifier.
# ------------------------------------------------------------------------------------------


class MathTask:
    """The verifier side of a math dataset, with the interface of `tasks.Task`.

    `verify(completion, problem)` is `rewards.math.grade` against `problem.answer` (1.0 or
    0.0): the whole check, in the calling process and with no deadline, so that the RL loop's
    reward pool (`rewards.isolation.verifier_pool`) runs it in parallel worker processes with
    its per-sample timeout. Run untrusted completions through such a pool, never in the
    trainer's process: a hostile answer can keep math-verify busy for minutes.
    `extract_answer` is the verifier's answer extraction (for majority voting).
    """

    name = "math"

    def verify(self, completion: str, problem: tasks.Problem) -> float:
        return math_reward.grade(completion, problem.answer)

    @staticmethod
    def extract_answer(completion: str) -> str | None:
        return math_reward.extract_answer(completion)
