"""Problem files as users bring them: verl parquet, TRL jsonl, Hugging Face `datasets`
directories and user-named fields, each written in its published layout by the library that
publishes it (`datasets`), read back and compared with what that library reads; the files
task's verifiers; bad input; and the files task from scratch (tokenizer, SFT, RL) on a toy
file. RL from a Hugging Face checkpoint on a verl file is `tests/test_math_e2e.py`."""

import json
import logging
import re

import datasets
import numpy as np
import pytest
from conftest import load_config, metric_lines

from rlscale import config_lib, rl, stage_cache
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import formats, math_data
from rlscale.tokenizers import chat

# verl's examples/data_preprocess/gsm8k.py, verbatim in what it writes.
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n=12, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(100, 2000, 2))
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples now?",
                "answer": f"Tom has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}",
            }
        )
    return rows


def verl_gsm8k(rows, split):
    """GSM8K rows as verl's preprocessing script turns them into its RL parquet's rows."""

    def extract_solution(solution_str):
        solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return solution.group(0).split("#### ")[1].replace(",", "")

    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": r["question"] + " " + VERL_GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": extract_solution(r["answer"])},
            "extra_info": {
                "split": split,
                "index": idx,
                "answer": r["answer"],
                "question": r["question"],
            },
        }
        for idx, r in enumerate(rows)
    ]


def write_verl_parquet(path, rows):
    """As verl writes it: a `datasets.Dataset` saved with `to_parquet`."""
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def trl_conversational_rows(n=6):
    return [
        {
            "prompt": [
                {"role": "system", "content": "You are a careful calculator."},
                {"role": "user", "content": f"What is {i} squared?"},
            ],
            "completion": [
                {"role": "assistant", "content": f"{i} times {i} is $\\boxed{{{i * i}}}$."}
            ],
        }
        for i in range(n)
    ]


def test_verl_parquet(tmp_path, caplog):
    raw = gsm8k_rows()
    rows = verl_gsm8k(raw, "test")
    rows[5]["data_source"] = "DigitalLearningGmbH/MATH-lighteval"
    path = write_verl_parquet(tmp_path / "test.parquet", rows)
    template = chat.get("qwen2.5")
    with caplog.at_level(logging.INFO, logger="absl"):
        problems = math_data.load({"test": str(path)}, "auto", str(tmp_path / "data"), template)
    problems = problems["test"]
    columns = "['ability', 'data_source', 'extra_info', 'prompt', 'reward_model']"
    assert f"{path}: format 'verl' detected from its columns {columns}" in caplog.messages
    reference = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert len(problems) == len(reference) == len(raw)
    for p, r in zip(problems, reference):
        assert p.prompt == chat.qwen2_5(r["prompt"])  # As written: no instruction appended.
        assert p.answer == r["reward_model"]["ground_truth"]
        assert p.id == str(r["extra_info"]["index"])
    golds = [gold.rsplit("#### ", 1)[1].replace(",", "") for gold in (r["answer"] for r in raw)]
    assert [p.answer for p in problems] == golds
    assert problems[3].source == "test.parquet:row3"
    # verl's data_source rule: GSM8K rows are graded as verl grades them, the rest as math.
    assert [p.verifier for p in problems] == ["gsm8k"] * 5 + ["math"] + ["gsm8k"] * 6
    task = math_data.FilesTask()
    gold = problems[0].answer
    assert problems[0].demo == f"#### {gold}"
    assert task.verify(f"So {gold[:-1]}+{gold[-1]}.\n#### {int(gold):,}", problems[0]) == 1.0
    assert task.verify(f"So \\boxed{{{gold}}}", problems[0]) == 0.0  # Not verl's format.
    assert task.verify(f"So \\boxed{{{problems[5].answer}}}", problems[5]) == 1.0


def test_trl_conversational_and_standard_jsonl(tmp_path):
    path = tmp_path / "trl.jsonl"
    datasets.Dataset.from_list(trl_conversational_rows()).to_json(str(path))  # JSON lines.
    standard = tmp_path / "standard.jsonl"
    datasets.Dataset.from_list(
        [{"prompt": f"{i}+{i}=", "solution": f"{2 * i}"} for i in range(5)]
    ).to_json(str(standard))
    splits = math_data.load(
        {"train": str(path), "test": str(standard)},  # One layout per file, both detected.
        "auto",
        str(tmp_path / "data"),
        chat.get("qwen3"),
        instruction="Be brief.",
        system="Ignored when the conversation has its own.",
    )
    train, test = splits["train"], splits["test"]
    messages = trl_conversational_rows()[3]["prompt"]
    assert train[3].prompt == chat.qwen3(messages)  # The system message is kept.
    assert train[3].answer == "9"
    assert train[3].demo == "3 times 3 is $\\boxed{9}$."
    system = [{"role": "system", "content": "Ignored when the conversation has its own."}]
    assert test[2].prompt == chat.qwen3([*system, {"role": "user", "content": "2+2=\nBe brief."}])
    assert (test[2].answer, test[2].demo) == ("4", "4")
    assert {formats.resolve_format(str(p), "auto") for p in (path, standard)} == {"trl"}
    # TRL's conversational language-modeling layout: the last assistant turn is the completion.
    lm = tmp_path / "messages.jsonl"
    conversations = [r["prompt"] + r["completion"] for r in trl_conversational_rows()]
    datasets.Dataset.from_list([{"messages": m} for m in conversations]).to_json(str(lm))
    row = math_data.load(str(lm), "auto", str(tmp_path / "data"), chat.get("qwen3"))["train"][5]
    assert row.prompt == chat.qwen3(conversations[5][:-1])
    assert (row.answer, row.demo) == ("25", "5 times 5 is $\\boxed{25}$.")


def test_datasets_directories(tmp_path):
    rows = [
        {"problem": f"Find x: x - {i} = 0.", "answer": str(i), "level": i % 3} for i in range(9)
    ]
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:6]),
            "validation": datasets.Dataset.from_list(rows[6:]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_list(rows[::-1]).save_to_disk(str(tmp_path / "one"))
    files = {"train": str(tmp_path / "dd"), "test": str(tmp_path / "dd" / "validation")}
    splits = math_data.load(files, "auto", str(tmp_path / "data"), instruction=None)
    reference = datasets.load_from_disk(str(tmp_path / "dd"))
    assert [p.prompt for p in splits["train"]] == reference["train"]["problem"]
    assert [p.answer for p in splits["test"]] == reference["validation"]["answer"]
    assert splits["test"][1].source == "dd/validation:row1"
    one = math_data.load(str(tmp_path / "one"), "polaris", str(tmp_path / "data"))["train"]
    assert [p.answer for p in one] == datasets.load_from_disk(str(tmp_path / "one"))["answer"]
    with pytest.raises(ValueError, match=r"splits \['train', 'validation'\] and no 'test'"):
        math_data.materialize({"test": str(tmp_path / "dd")}, "auto", str(tmp_path / "data"))


def test_user_named_fields(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"q": f"{i}*3=", "meta": {"gold": i * 3, "level": 1}, "work": f"{i}*3={i * 3}"}
        for i in range(7)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"prompt": "q", "answer": "meta.gold", "demo": "work"}
    assert formats.resolve_format(str(path), "auto", fields) == "fields"
    problems = math_data.load(
        str(path), "auto", str(tmp_path / "data"), fields=fields, verifier="exact", instruction=None
    )["train"]
    assert [(p.prompt, p.answer, p.demo) for p in problems] == [
        (r["q"], str(r["meta"]["gold"]), r["work"]) for r in rows
    ]
    assert {p.verifier for p in problems} == {"exact"}
    # The same rows as one JSON array, and as the JSON lines `datasets` writes to `.json`.
    array, lines = tmp_path / "mine.json", tmp_path / "lines.json"
    array.write_text(json.dumps(rows, indent=1))
    datasets.Dataset.from_list(rows).to_json(str(lines))
    for other in (array, lines):
        again = math_data.load(
            str(other), "auto", str(tmp_path / "data"), fields=fields, instruction=None
        )
        assert [(p.prompt, p.answer, p.demo) for p in again["train"]] == [
            (p.prompt, p.answer, p.demo) for p in problems
        ]
    rows[3]["q"] = 7
    array.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=re.escape(f"{array}, row index 3: field 'q' must be a")):
        math_data.materialize(str(array), "fields", str(tmp_path / "data"), fields)
    # Without a demo column, the warm start imitates the gold in the verifier's format.
    bare = math_data.load(
        str(path), "fields", str(tmp_path / "data"), fields={"prompt": "q", "answer": "meta.gold"}
    )["train"]
    assert bare[4].demo == "\\boxed{12}"


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("Paris", "Paris", 1.0),
        ("  Paris \n", "Paris", 1.0),
        ("It is Paris.\nAnswer: Paris", "Paris", 1.0),
        ("answer: New York", "New York", 1.0),
        ("<think>\nParis?\n</think>\n\nLyon", "Paris", 0.0),
        ("<think>\nParis", "Paris", 0.0),  # The thinking never ended: no answer.
        ("\\boxed{x+1} so Answer: 3", "x+1", 1.0),  # A box wins over an answer line.
        ("\\boxed{1} then \\boxed{2", "1", 0.0),  # A malformed last box: no answer.
        ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),  # Strings, not values.
    ],
)
def test_exact_verifier(completion, gold, expected):
    assert math_data.exact(completion, gold) == expected


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("so #### 1,234", "1234", 1.0),
        ("#### 12 then #### 13", "13", 1.0),  # The last one.
        ("####12", "12", 0.0),  # verl's strict rule needs the space.
        ("#### $12", "12", 0.0),
        ("\\boxed{12}", "12", 0.0),
        ("#### 12" + " " * 400, "12", 0.0),  # Only the last 300 characters are read.
    ],
)
def test_gsm8k_verifier_is_verls_strict_rule(completion, gold, expected):
    assert math_data.gsm8k(completion, gold) == expected


def test_no_matching_layout_lists_columns_and_formats(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"text": "1+1", "label": "2"}) + "\n")
    with pytest.raises(ValueError) as e:
        math_data.materialize(str(path), "auto", str(tmp_path / "data"))
    message = str(e.value)
    assert str(path) in message and "columns ['label', 'text']" in message
    assert all(f"{name} (" in message for name in formats.FORMATS)
    parquet = tmp_path / "odd.parquet"
    datasets.Dataset.from_list([{"text": "1+1", "label": "2"}]).to_parquet(str(parquet))
    with pytest.raises(ValueError, match=re.escape("columns ['label', 'text']; formats tried")):
        math_data.materialize(str(parquet), "auto", str(tmp_path / "data"))
    with pytest.raises(ValueError, match=re.escape("no column for task.fields.answer='y'")):
        math_data.materialize(
            str(path), "auto", str(tmp_path / "data"), {"prompt": "text", "answer": "y"}
        )


def _bad_row(rows, i, change):
    rows = json.loads(json.dumps(rows))
    change(rows[i])
    return rows


BAD_ROWS = [
    (
        "verl",
        lambda r: r["reward_model"].pop("ground_truth"),
        "missing field 'reward_model.ground_truth'",
    ),
    ("verl", lambda r: r.update(prompt=[{"role": "bot", "content": "hi"}]), "role 'bot'"),
    ("verl", lambda r: r.update(prompt=[]), "empty list of chat messages"),
    ("trl", lambda r: r["completion"][0].update(role="user"), "must be assistant turns"),
    ("trl", lambda r: r["completion"][0].update(content="$\\boxed{4"), "unbalanced"),
    ("trl", lambda r: r["prompt"].reverse(), "a system message may only come first"),
]


@pytest.mark.parametrize("layout, change, message", BAD_ROWS)
def test_malformed_row_names_file_and_row(tmp_path, layout, change, message):
    rows = verl_gsm8k(gsm8k_rows(6), "train") if layout == "verl" else trl_conversational_rows()
    rows = _bad_row(rows, 4, change)
    path = tmp_path / "bad.jsonl"  # JSON lines: a Parquet column's type would refuse some.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pattern = re.escape(f"{path}, line 5: ") + ".*" + re.escape(message)
    with pytest.raises(ValueError, match=pattern):
        math_data.materialize(str(path), layout, str(tmp_path / "data"))


def test_malformed_parquet_and_datasets_rows_name_the_row(tmp_path):
    rows = verl_gsm8k(gsm8k_rows(6), "train")
    rows[2]["reward_model"]["ground_truth"] = "  "
    path = write_verl_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=re.escape(f"{path}, row index 2: field 'reward_model.")):
        math_data.materialize(str(path), "auto", str(tmp_path / "data"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad_dir"))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'bad_dir'}, row index 2: ")):
        math_data.materialize(str(tmp_path / "bad_dir"), "verl", str(tmp_path / "data"))


def test_chat_prompt_without_a_chat_template_names_file_and_row(tmp_path):
    path = write_verl_parquet(tmp_path / "v.parquet", verl_gsm8k(gsm8k_rows(3), "train"))
    with pytest.raises(ValueError) as e:
        math_data.load(str(path), "auto", str(tmp_path / "data"), template=None)
    assert "v.parquet:row0: the prompt is a list of chat messages" in str(e.value)
    assert "task.chat_template is empty" in str(e.value)


def _files_config(train, test, **task):
    c = config_lib.rl_config()
    c.task = config_lib.files_task(files={"train": str(train), "test": str(test)}, **task)
    return c


def test_chat_prompts_from_scratch_tokenizer_and_stop_tokens(tmp_path):
    """From scratch on chat prompts: the tokenizer trained on the rendered prompts keeps the
    template's end-of-turn marker as one token, and sampling stops at it."""
    from rlscale import saved_policy
    from rlscale.rl import setup

    path = write_verl_parquet(tmp_path / "v.parquet", verl_gsm8k(gsm8k_rows(40), "train"))
    config = _files_config(path, path, chat_template="qwen2.5")
    problems = math_data.load(str(path), "auto", str(tmp_path / "data"), chat.get("qwen2.5"))
    tok = setup._tokenizer(config.tokenizer, config.task, str(tmp_path), problems["train"])
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and tok.decode(end) == "<|im_end|>"
    assert problems["train"][0].prompt.count("<|im_end|>") == 2  # System and user turns.
    saved = saved_policy.resolve(config)
    scfg = saved_policy.sampling_config(saved.sampling, saved.task, tok, 1)
    assert scfg.stop_tokens == (end[0], tok.eos_id)
    (tmp_path / "plain").mkdir()
    plain_config = _files_config(path, path)
    plain_dir = str(tmp_path / "plain")
    train = problems["train"]
    plain = setup._tokenizer(plain_config.tokenizer, plain_config.task, plain_dir, train)
    assert len(plain.encode("<|im_end|>")) > 1  # Without a template it is ordinary text.
    # A model whose tokenizer lacks the template's end-of-turn token does not use that template.
    with pytest.raises(ValueError, match=re.escape("task.chat_template='qwen2.5': the tokenizer")):
        saved_policy.sampling_config(saved.sampling, saved.task, plain, 1)


def test_bad_files_task_config_lists_every_problem(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    config = _files_config(
        tmp_path / "missing.jsonl",
        tmp_path / "x.csv",
        verifier="regex",
        format="alpaca",
        chat_template="qwen9",
    )
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    message = str(e.value)
    assert "task.files.train=" in message and "missing.jsonl': no such file" in message
    assert "x.csv': unsupported file type" in message
    assert "task.verifier='regex' is not a verifier: one of ('auto', 'math', 'exact', 'gsm8k')" in (
        message
    )
    assert "task.format='alpaca' is not one of" in message
    assert "task.chat_template='qwen9' is not one of" in message
    config = _files_config("", tmp_path, fields={"answer": "answer"})
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "task.files.train is not set" in str(e.value)
    assert f"task.files.test={str(tmp_path)!r}: {tmp_path} is a directory but not a" in str(e.value)
    config = _files_config(ok, ok, fields={"answer": "answer"})
    with pytest.raises(ValueError, match="task.fields.prompt and task.fields.answer must both"):
        rl.resolve(config)
    rl.resolve(_files_config(ok, ok))  # From scratch: no checkpoint needed.
    with pytest.raises(ValueError, match="unknown verifier 'regex'; verifiers: auto, math"):
        math_data.load(str(ok), "auto", str(tmp_path / "data"), verifier="regex")


def _toy_rows(n, seed):
    rng = np.random.default_rng(seed)
    return [
        {"q": f"{a}+{b}=", "a": str(a + b)} for a, b in (rng.integers(0, 50, 2) for _ in range(n))
    ]


@pytest.mark.slow
def test_files_task_from_scratch(tmp_path):
    """The quickstart's path on a user's file: tokenizer trained on its prompts, SFT on its
    golds, then two RL steps (`configs/files.py:smoke`)."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    for path, rows in ((train, _toy_rows(500, 0)), (test, _toy_rows(40, 1))):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arg = f"train={train},test={test},prompt=q,answer=a,verifier=exact,smoke"
    config = load_config("files", arg)
    assert config.task.name == "files" and not config.init.hf_checkpoint
    # Smaller than `:smoke` (compiling is most of this test's time): one device, two layers,
    # ten SFT steps with one evaluation.
    config.steps, config.mesh.shape, config.model.num_layers = 2, (1, 1, 1), 2
    config.sft.max_steps, config.sft.eval_every, config.sft.batch_size = 10, 10, 32
    config.eval.prompts, config.sampling.max_new_tokens = 8, 16
    config.reward.workers = 0
    workdir = tmp_path / "run"
    summary = rl.run(rl.resolve(config), str(workdir))
    lines = metric_lines(workdir)
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert all(np.isfinite(x["train/loss"]) for x in lines[1:])
    sft = stage_cache.record(str(workdir), stage_cache.WARM_START)
    assert sft["steps"] == config.sft.max_steps and np.isfinite(sft["loss"])
    tok = tokenizer_lib.load(str(workdir / "tokenizer.model"))
    # Trained on the prompts and the "\boxed{N}" demonstrations: merges beyond the bytes.
    assert len(tok.encode("\\boxed{")) < len("\\boxed{")
    assert summary["compute/flops"] > 0
