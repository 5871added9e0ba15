"""Any recipe on a local Hugging Face checkpoint and local problem files (verl parquet, TRL,
GSM8K, MATH or Polaris style, or a `datasets` directory: the files task).

    python -m rlscale.main --config configs/math.py:checkpoint=/models/Qwen2.5-0.5B-Instruct,\\
        train=/data/gsm8k/train.parquet,test=/data/gsm8k/test.parquet,template=qwen2.5 \\
        --workdir /tmp/rlscale_math

Variants: `checkpoint` (a HF model directory: config.json, safetensors, tokenizer.json),
`train` / `test` (.jsonl, .json, .parquet or `datasets` directories), `format` (auto | gsm8k |
math | polaris | verl | trl | fields: `rlscale.data.formats`; `fields` reads the columns that
`--config.task.fields.prompt=...` and `--config.task.fields.answer=...` name), `verifier`
(auto | math | exact | gsm8k), `template` (llama3 | qwen2 | qwen2.5 | qwen3 | gemma, or none),
`recipe` (grpo | dapo | drgrpo | gspo | cispo | scalerl: the objective and filters of that
recipe file), `smoke` (2 tiny steps: the tests). The policy starts from the checkpoint (no
SFT), rewards come from the task's verifier (`FilesTask.verify`: math-verify, or verl's GSM8K
rule for `openai/gsm8k` rows; run in the reward worker pool with the verifier's deadline per
sample), and the trained policy is exported to WORKDIR/hf with the tokenizer files, loadable
by transformers and vLLM.

Runtime and result depend on the model and hardware: a 0.5B model needs an accelerator (this
config has not been run at that scale here: the tests run it on a tiny random Qwen2-shaped
checkpoint and a 20-row file, where it takes about a minute on a 2-core CPU and the reward
stays at 0).
"""

import importlib.util
import os

from rlscale import config_lib
from rlscale.rewards import math as math_reward
from rlscale.tokenizers import chat

RECIPES = ("grpo", "dapo", "drgrpo", "gspo", "cispo", "scalerl")


def _recipe(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"rlscale_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config(arg=None):
    arg = config_lib.parse_arg(
        arg,
        checkpoint="",
        train="",
        test="",
        format="auto",
        verifier="auto",
        template="qwen2.5",
        recipe="grpo",
        smoke=False,
    )
    if arg.recipe not in RECIPES:
        raise ValueError(f"config variant recipe={arg.recipe!r} is not one of {RECIPES}")
    c = _recipe(arg.recipe)
    c.recipe = f"math_{arg.recipe}"
    c.init.hf_checkpoint = arg.checkpoint
    c.task = config_lib.files_task(
        format=arg.format,
        files={"train": arg.train, "test": arg.test},
        verifier=arg.verifier,
        chat_template="" if arg.template == "none" else arg.template,
        instruction="Please reason step by step, and put your final answer within \\boxed{}.",
    )
    c.model.dtype = "bfloat16"
    c.steps = 200
    c.batch.prompts, c.batch.group_size = 64, 8
    c.sampling.max_new_tokens = 1024
    c.sampling.buckets = (128, 256, 512)
    c.sampling.interrupt_phrase = chat.FORCED_INTERRUPTION
    c.sampling.think_end = "</think>"
    if c.sampling.think_budget:
        c.sampling.think_budget = 768
    c.optim.lr = 1e-6
    c.eval.every, c.eval.prompts, c.eval.samples = 10, 256, 4
    c.reward.timeout = math_reward.DEFAULT_TIMEOUT
    if arg.smoke:
        c.model.dtype = "float32"
        c.steps = 2
        c.batch.prompts, c.batch.group_size = 8, 2
        c.sampling.max_new_tokens = 8
        c.sampling.think_budget = 0
        c.sampling.buckets = (128, 256)
        c.eval.every, c.eval.prompts, c.eval.samples = 2, 8, 1
        c.checkpoint.every = 2
    return c
