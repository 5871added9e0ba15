"""Problem files as users bring them: storage (.jsonl, .json, .parquet, `datasets` directories),
layouts (verl, trl, gsm8k, math, polaris, user-named fields) and `format="auto"` detection; every
malformed row is an error naming its file and row. Tables: docs/data.md.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping

from absl import logging

from rlscale.rewards import math as math_reward
from rlscale.tokenizers import chat

FORMATS = ("gsm8k", "math", "polaris", "verl", "trl", "fields")
EXTENSIONS = (".jsonl", ".json", ".parquet")
# What each layout needs, in the order `detect` tries them (for error messages).
LAYOUTS = {
    "fields": "the columns named by task.fields.prompt and task.fields.answer",
    "verl": "prompt + reward_model (.ground_truth)",
    "trl": "prompt + completion, solution or answer; or messages",
    "gsm8k": "question + answer",
    "math": "problem + solution",
    "polaris": "problem + answer",
}
BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ID_FIELDS = ("unique_id", "id")
_TRL_REFERENCES = ("completion", "solution")


@dataclasses.dataclass(frozen=True)
class Fields:
    """User-named columns of the `fields` layout (dotted names reach into nested fields)."""

    prompt: str = ""
    answer: str = ""
    demo: str = ""

    @classmethod
    def of(cls, fields) -> "Fields":
        """From None, a `Fields` or a mapping such as the `task.fields` config."""
        if fields is None or isinstance(fields, Fields):
            return fields or cls()
        if hasattr(fields, "to_dict"):  # An ml_collections ConfigDict.
            fields = fields.to_dict()
        return cls(**dict(fields))


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
    boxes = list(BOX_RE.finditer(solution))
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
# Fields of one row.
# ------------------------------------------------------------------------------------------


def _lookup(record: dict, name: str):
    """`record[name]`, following dots into nested objects; None when absent."""
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _text_field(record: dict, field: str, *, numbers: bool = False) -> str:
    value = _lookup(record, field)
    if value is None:
        raise ValueError(f"missing field {field!r}")
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"field {field!r} is empty")
    return value


def _messages(value, field: str) -> list[dict]:
    """A validated list of chat messages ({role, content}; other keys are dropped)."""
    if not value:
        raise ValueError(f"field {field!r} is an empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(
                f"field {field!r}, message {i}: must be an object with role and content, "
                f"got {type(m).__name__}"
            )
        role, content = m.get("role"), m.get("content")
        if role not in chat.ROLES:
            raise ValueError(
                f"field {field!r}, message {i}: role {role!r} is not one of {chat.ROLES}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"field {field!r}, message {i}: content must be a string, "
                f"got {type(content).__name__}"
            )
        if role == "system" and i > 0:
            raise ValueError(f"field {field!r}, message {i}: a system message may only come first")
        out.append({"role": role, "content": content})
    return out


def _prompt_field(record: dict, field: str) -> tuple[str, list[dict] | None]:
    """(text, None) for a text prompt, ("", messages) for a chat prompt."""
    value = _lookup(record, field)
    if isinstance(value, list):
        messages = _messages(value, field)
        if messages[-1]["role"] == "assistant":
            raise ValueError(f"field {field!r}: a chat prompt must not end with an assistant turn")
        return "", messages
    return _text_field(record, field), None


def _completion_field(record: dict, field: str) -> str:
    """A reference completion: a string, or assistant messages (their contents joined)."""
    value = _lookup(record, field)
    if isinstance(value, list):
        messages = _messages(value, field)
        if any(m["role"] != "assistant" for m in messages):
            raise ValueError(f"field {field!r}: a completion's messages must be assistant turns")
        value = "".join(m["content"] for m in messages)
        if not value.strip():
            raise ValueError(f"field {field!r} is empty")
        return value
    return _text_field(record, field)


def _gold_of_reference(reference: str, field: str) -> str:
    """The gold answer a reference completion states: its last box, else all of it."""
    if BOX_RE.search(reference):
        gold = boxed_answer(reference)
        if gold is None:
            raise ValueError(f"field {field!r}: its last \\boxed{{...}} is unbalanced")
        return gold
    return reference


def _row_id(record: dict) -> str:
    for field in _ID_FIELDS:
        if record.get(field) is not None:
            return str(record[field])
    return ""


def _trl(record: dict) -> dict:
    if record.get("prompt") is None and record.get("messages") is not None:
        messages = _messages(record["messages"], "messages")
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise ValueError("field 'messages' must end with an assistant turn after the prompt")
        prompt, messages, demo = "", messages[:-1], messages[-1]["content"]
        ref_field = "messages"
    else:
        prompt, messages = _prompt_field(record, "prompt")
        ref_field = next((f for f in _TRL_REFERENCES if record.get(f) is not None), None)
        demo = _completion_field(record, ref_field) if ref_field else ""
    if record.get("answer") is not None:
        gold = _text_field(record, "answer", numbers=True)
    elif ref_field:
        gold = _gold_of_reference(demo, ref_field)
    else:
        raise ValueError("missing field 'completion', 'solution' or 'answer' (the gold)")
    return dict(prompt=prompt, messages=messages, answer=gold, demo=demo, id=_row_id(record))


def _verl(record: dict) -> dict:
    prompt, messages = _prompt_field(record, "prompt")
    if not isinstance(record.get("reward_model"), dict):
        raise ValueError("missing field 'reward_model' (an object with 'ground_truth')")
    gold = _text_field(record, "reward_model.ground_truth", numbers=True)
    source = record.get("data_source")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"field 'data_source' must be a string, got {type(source).__name__}")
    index = _lookup(record, "extra_info.index")
    return dict(
        prompt=prompt,
        messages=messages,
        answer=gold,
        data_source=source or "",
        id=_row_id(record) if index is None else str(index),
    )


def _fields(record: dict, fields: Fields) -> dict:
    if not (fields.prompt and fields.answer):
        raise ValueError("format 'fields' needs task.fields.prompt and task.fields.answer")
    prompt, messages = _prompt_field(record, fields.prompt)
    gold = _text_field(record, fields.answer, numbers=True)
    demo = _completion_field(record, fields.demo) if fields.demo else ""
    return dict(prompt=prompt, messages=messages, answer=gold, demo=demo, id=_row_id(record))


def parse_record(record, fmt: str, fields: Fields | None = None) -> dict:
    """One row as {prompt, messages, answer, demo, data_source, id} (module docstring).

    Raises:
      ValueError: Saying what is wrong with the row (the caller adds the file and row).
    """
    if not isinstance(record, dict):
        raise ValueError(f"a row must be a JSON object, got {type(record).__name__}")
    row = dict(prompt="", messages=None, demo="", data_source="", id=_row_id(record))
    if fmt == "gsm8k":
        row["prompt"] = _text_field(record, "question")
        row["answer"] = gsm8k_gold(_text_field(record, "answer"))
        if row["answer"] is None:
            raise ValueError("field 'answer' has no '####' before the final answer")
    elif fmt == "math":
        row["prompt"] = _text_field(record, "problem")
        if record.get("answer") is not None:
            row["answer"] = _text_field(record, "answer", numbers=True)
        else:
            row["answer"] = boxed_answer(_text_field(record, "solution"))
            if row["answer"] is None:
                raise ValueError(
                    "field 'solution' has no \\boxed{...} answer (or its last box is unbalanced)"
                )
    elif fmt == "polaris":
        row["prompt"] = _text_field(record, "problem")
        row["answer"] = _text_field(record, "answer", numbers=True)
    elif fmt == "verl":
        row.update(_verl(record))
    elif fmt == "trl":
        row.update(_trl(record))
    elif fmt == "fields":
        row.update(_fields(record, Fields.of(fields)))
    else:
        raise ValueError(f"unknown dataset format {fmt!r}; formats: auto, {', '.join(FORMATS)}")
    row["answer"] = row["answer"].strip()
    if not row["answer"]:
        raise ValueError("the gold answer is empty")
    row["messages"] = json.dumps(row["messages"]) if row["messages"] else ""
    return row


# ------------------------------------------------------------------------------------------
# Storage: JSON lines, Parquet, Hugging Face `datasets` directories.
# ------------------------------------------------------------------------------------------


def dataset_dir(path: str, split: str) -> str:
    """The `datasets` directory to read for a split: `path` itself (a `Dataset`), or its
    `split` subdirectory (a `DatasetDict`).

    Raises:
      ValueError: If `path` is not a `save_to_disk` directory, or a `DatasetDict` without
        that split (the message lists the splits it has).
    """
    dict_json = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_json):
        with open(dict_json) as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise ValueError(
                f"{path} is a Hugging Face DatasetDict with splits {splits} and no {split!r}; "
                f"point task.files.{split} at one of "
                + ", ".join(os.path.join(path, s) for s in splits)
            )
        path = os.path.join(path, split)
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise ValueError(
            f"{path} is a directory but not a Hugging Face datasets directory "
            "(no state.json or dataset_dict.json, as Dataset.save_to_disk writes)"
        )
    return path


def _arrow_files(path: str) -> list[str]:
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    files = [os.path.join(path, d["filename"]) for d in state.get("_data_files", [])]
    if not files:
        raise ValueError(f"{path}/state.json lists no data files")
    return files


def check_path(path: str) -> str | None:
    """What is wrong with a data path (a `.jsonl` / `.json` / `.parquet` file or a `datasets`
    directory), or None. Reads no rows."""
    if os.path.isdir(path):
        return None
    if not os.path.exists(path):
        return "no such file"
    if not path.endswith(EXTENSIONS):
        return (
            f"unsupported file type; expected {', '.join(EXTENSIONS)}, or a Hugging Face "
            "datasets directory (save_to_disk)"
        )
    return None


MAX_LISTED = 10  # Malformed rows named in one error; the rest are counted.


def kind(value) -> str:
    """A JSON value's type, as a message names it."""
    return "null" if value is None else type(value).__name__


def malformed_rows(path: str, errors: list[str]) -> str:
    """One message for a file's malformed rows (each already naming its line): the first
    `MAX_LISTED` listed, the rest counted."""
    more = len(errors) - MAX_LISTED
    return (
        f"{path}: {len(errors)} malformed row{'s' if len(errors) > 1 else ''}: "
        + "; ".join(errors[:MAX_LISTED])
        + (f"; and {more} more" if more > 0 else "")
    )


def _batches(batches, label: str):
    i = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"row index {i}", f"{label}:row{i}", record
            i += 1


def _is_json_array(path: str) -> bool:
    """Whether a `.json` file holds one JSON array (its first non-blank byte is `[`)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4096), b""):
            block = block.lstrip()
            if block:
                return block.startswith(b"[")
    return False


def records(path: str) -> Iterator[tuple[str, str, object]]:
    """Yields (where, source, record) for each row of a file or `datasets` directory (already
    resolved to one split by `dataset_dir`).

    `where` names the row in error messages, `source` is its short id, and `record` is the
    parsed row or, for a line that is not JSON, the ValueError to report.
    """
    if os.path.isdir(path):
        import pyarrow as pa

        path = os.path.normpath(path)
        label = os.path.basename(path)
        if os.path.isfile(os.path.join(os.path.dirname(path), "dataset_dict.json")):
            label = f"{os.path.basename(os.path.dirname(path))}/{label}"  # DatasetDict/split.

        def batches():
            for name in _arrow_files(path):
                with pa.memory_map(name) as source:
                    yield from pa.ipc.open_stream(source)

        yield from _batches(batches(), label)
    elif path.endswith(".json") and _is_json_array(path):
        with open(path, "rb") as f:
            try:
                rows = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a JSON array: {e}") from None
        label = os.path.basename(path)
        for i, record in enumerate(rows):
            yield f"row index {i}", f"{label}:row{i}", record
    elif path.endswith((".jsonl", ".json")):
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

        yield from _batches(pq.ParquetFile(path).iter_batches(), os.path.basename(path))
    else:
        raise ValueError(f"{path!r}: {check_path(path)}")


def columns(path: str) -> list[str]:
    """The column names of a file or `datasets` directory (JSON: the first row's keys)."""
    if os.path.isdir(path):
        import pyarrow as pa

        with pa.memory_map(_arrow_files(path)[0]) as source:
            return list(pa.ipc.open_stream(source).schema.names)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    for where, _, record in records(path):
        if isinstance(record, ValueError):
            raise ValueError(f"{path}, {where}: {record}")
        if not isinstance(record, dict):
            raise ValueError(f"{path}, {where}: a row must be a JSON object")
        return list(record)
    return []


def detect(cols, fields: Fields | None = None) -> str | None:
    """The layout of a file with these columns, or None (rules in the module docstring)."""
    cols, fields = set(cols), Fields.of(fields)
    if fields.prompt:
        return "fields"
    if {"prompt", "reward_model"} <= cols:
        return "verl"
    if ("prompt" in cols and cols & {*_TRL_REFERENCES, "answer"}) or "messages" in cols:
        return "trl"
    if {"question", "answer"} <= cols:
        return "gsm8k"
    if {"problem", "solution"} <= cols:
        return "math"
    if {"problem", "answer"} <= cols:
        return "polaris"
    return None


def resolve_format(path: str, fmt: str, fields: Fields | None = None) -> str:
    """`fmt`, or for "auto" the layout `detect` finds in the file (logged).

    Raises:
      ValueError: For "auto" when no layout matches, listing the columns found and the
        layouts tried; for "fields" when the named columns are not in the file.
    """
    fields = Fields.of(fields)
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"unknown dataset format {fmt!r}; formats: auto, {', '.join(FORMATS)}")
    if fmt not in ("auto", "fields"):
        return fmt
    cols = columns(path)
    found = detect(cols, fields) if fmt == "auto" else "fields"
    if found is None:
        tried = "; ".join(f"{name} ({need})" for name, need in LAYOUTS.items())
        raise ValueError(
            f"{path}: no known layout matches its columns {sorted(cols)}; formats tried: "
            f"{tried}. Name the columns with task.fields.prompt and task.fields.answer"
        )
    if found == "fields":
        named = {"prompt": fields.prompt, "answer": fields.answer, "demo": fields.demo}
        missing = [
            f"task.fields.{key}={name!r}"
            for key, name in named.items()
            if (name or key != "demo") and name.split(".")[0] not in cols
        ]
        if missing:
            raise ValueError(f"{path}: no column for {', '.join(missing)}; columns: {sorted(cols)}")
    if fmt == "auto" and found == "fields":
        logging.info("%s: format 'fields' (task.fields names the columns)", path)
    elif fmt == "auto":
        logging.info("%s: format %r detected from its columns %s", path, found, sorted(cols))
    return found


def read_rows(path: str, fmt: str, fields: Fields | Mapping | None = None) -> list[dict]:
    """Reads and validates a file or `datasets` directory: its rows, in order, each with
    `parse_record`'s fields and its `source` (`file:line` or `file:rowN`).

    Args:
      path: A `.jsonl`, `.json` or `.parquet` file, or a `datasets` directory resolved to one
        split.
      fmt: One of `FORMATS`, or "auto".
      fields: The `fields` layout's column names.

    Raises:
      FileNotFoundError: If `path` does not exist.
      ValueError: On an unknown format or file type, a layout that does not match, an empty
        file, or a malformed row, naming the file and the 1-based line (JSON lines) or the
        0-based row index (Parquet, `datasets`, a JSON array).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    fields = Fields.of(fields)
    fmt = resolve_format(path, fmt, fields)
    rows = []
    for where, source, record in records(path):
        try:
            if isinstance(record, ValueError):
                raise record
            row = parse_record(record, fmt, fields)
        except ValueError as e:
            raise ValueError(f"{path}, {where}: {e}") from None
        rows.append({**row, "source": source})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def digest(path: str) -> str:
    """sha256 of a file's bytes, or of a `datasets` directory's Arrow files (in order)."""
    h = hashlib.sha256()
    for p in _arrow_files(path) if os.path.isdir(path) else [path]:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
