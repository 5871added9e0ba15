"""Your own problem files, from scratch: a tokenizer trained on the prompts, an SFT warm start
on the demonstrations, then RL with the quickstart's recipe and tiny policy.

    python -m rlscale.main --config configs/files.py:train=/tmp/add_train.jsonl,\\
        test=/tmp/add_test.jsonl,prompt=q,answer=a,verifier=exact --workdir /tmp/rlscale_files

Measured on the toy files of docs/data.md, "The files task from scratch" (2,000 two-digit
additions `{"q": "What is 86 + 87?", "a": "173"}`, 200 held-out): 3 min 37 s on a 2-core CPU
shared with other jobs (2 min 6 s of CPU time), SFT warm start (400 steps) and compilation
included. Held-out pass@1 0.805 (the warm start, stopped at its first evaluation above
`sft.target_pass`) -> 0.93 after 80 RL steps (seed 1, same warm start: 0.814 -> 0.9425).

Files: `.jsonl`, `.json`, `.parquet` or a Hugging Face `datasets` directory, in any layout of
`rlscale.data.formats` (gsm8k, math, polaris, verl, trl; detected from the columns), or with
the columns named by `prompt=`, `answer=` and optionally `demo=` (a worked completion). The
warm start imitates the demonstrations (`demo=`, a TRL completion or solution), else the gold
answer in the verifier's format (`\\boxed{42}`). Variants: `train`, `test`, `format` (auto |
gsm8k | math | polaris | verl | trl | fields), `prompt` / `answer` / `demo` (column names),
`verifier` (auto | math | exact | gsm8k; any other reward: `--config.reward.fn=module:fn`),
`template` (a chat template family for chat-message prompts, or none), `smoke` (a few steps
of everything: the tests). From a Hugging Face checkpoint instead, use `configs/math.py`.
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(
        arg,
        train="",
        test="",
        format="auto",
        prompt="",
        answer="",
        demo="",
        verifier="auto",
        template="none",
        smoke=False,
    )
    c = config_lib.rl_config()
    c.recipe = "files"
    c.steps = 80
    c.eval.every = 5
    c.optim.lr = 1.5e-4
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.filters.zero_variance = True
    # Every demonstration states its answer: the synthetic tasks' answer-less demonstrations
    # need their "Answer: N" line format, which a user's file does not have.
    c.sft.answer_line_fraction = 1.0
    # Evaluated every 100 steps, the warm start stops soon after `sft.target_pass` (0.5).
    c.sft.eval_every = 100
    if arg.template != "none":  # Chat headers (and a default system prompt) lengthen prompts.
        c.sampling.buckets, c.model.max_seq_len = (32, 64, 128), 256
    if arg.smoke:
        config_lib.smoke(c)  # Before the task is set: it sizes the synthetic tasks.
    c.task = config_lib.files_task(
        files={"train": arg.train, "test": arg.test},
        format=arg.format,
        fields=dict(prompt=arg.prompt, answer=arg.answer, demo=arg.demo),
        verifier=arg.verifier,
        chat_template="" if arg.template == "none" else arg.template,
    )
    return c
