"""Hugging Face Hub names where paths are read (`rlscale.hub`), without a network: a Hub cache
laid out in tmp_path as huggingface_hub lays it out (`models--org--name/{blobs, refs,
snapshots}`, checked by the library's own `scan_cache_dir`) holding a tiny Hugging Face
checkpoint and a problem file, read with HF_HUB_OFFLINE=1. (An RL run on a checkpoint and a
problem file named on the Hub: tests/test_math_e2e.py.)"""

import hashlib
import json
import os
import subprocess
import sys

import huggingface_hub
import jax
import pytest
import tokenizers
from conftest import subprocess_env
from huggingface_hub import constants
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlscale import hub, rl
from rlscale import model as model_lib
from rlscale.model import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL, DATA = "tiny-org/tiny-qwen", "tiny-org/tiny-gsm8k"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _commit(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()  # 40 hex digits, as a git commit.


def write_cached_repo(cache, repo_type: str, repo_id: str, files: dict, refs=("main",)) -> str:
    """A repository snapshot in huggingface_hub's cache layout (its docs' "cache-system"):
    each file a blob named by its hash under `blobs/`, linked from `snapshots/<commit>/<path>`;
    each of `refs` a file holding the commit. `files`: path in repo -> bytes. Returns the
    snapshot directory."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = _commit(f"{repo_type}/{repo_id}")
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return str(folder / "snapshots" / commit)


def _rows(n=8):
    return [
        {"question": f"Tom has {a} apples and buys 2 more. How many?", "answer": f"#### {a + 2}"}
        for a in range(3, 3 + n)
    ]


def bpe_tokenizer_dir(path, corpus, vocab_size: int) -> int:
    """A byte-level BPE `tokenizer.json` trained on `corpus`, with ChatML's special tokens and
    a `tokenizer_config.json`, in `path`, as Qwen's checkpoints hold it; its vocabulary size."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return backend.get_vocab_size()


def _tiny_checkpoint(directory, corpus) -> None:
    """A tiny Llama-shaped checkpoint with a BPE `tokenizer.json` (the chat template's special
    tokens included), written by rlscale's own export (`hf.save_hf`)."""
    directory.mkdir()
    vocab = bpe_tokenizer_dir(directory, corpus, 320)
    cfg = model_lib.get("tiny", vocab_size=vocab, tie_embeddings=True)
    hf.save_hf(str(directory), cfg, model_lib.init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The Hub cache: `MODEL` (main and the tag v1) and `DATA` (a GSM8K-style file)."""
    root = tmp_path_factory.mktemp("hub")
    rows = _rows()
    corpus = [r["question"] + r["answer"] for r in rows] + [
        "system user assistant Please reason step by step, and put your final answer within "
        "\\boxed{}. You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ] * 5
    _tiny_checkpoint(root / "made", corpus)
    cache = root / "cache"
    files = {p.name: p.read_bytes() for p in (root / "made").iterdir()}
    write_cached_repo(cache, "model", MODEL, files, refs=("main", "v1"))
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_cached_repo(cache, "dataset", DATA, {"main/train.jsonl": jsonl})
    return cache


@pytest.fixture
def offline(cache, monkeypatch):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE at `cache`, for this process (huggingface_hub reads
    its environment once, at import: its constants too) and the processes it starts."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_the_cache_layout_is_huggingface_hubs(cache):
    """The library's own cache scan reads the hand-written layout: both repositories, the
    model's commit under both refs, every file."""
    info = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(cache).repos}
    assert set(info) == {MODEL, DATA}
    (revision,) = info[MODEL].revisions
    assert revision.commit_hash == _commit(f"model/{MODEL}")
    assert revision.refs == {"main", "v1"}
    assert {f.file_name for f in revision.files} >= {"config.json", "tokenizer.json"}
    assert info[DATA].repo_type == "dataset"


def test_names_resolve_from_the_cache(offline):
    commit = _commit(f"model/{MODEL}")
    snapshot = str(offline / "models--tiny-org--tiny-qwen" / "snapshots" / commit)
    for name in (
        MODEL,
        f"{MODEL}@{commit}",
        f"{MODEL}@v1",
        f"hf://{MODEL}",
        f"hf://models/{MODEL}",
    ):
        assert hub.local_path(name, "init.hf_checkpoint") == snapshot, name
    data = f"hf://datasets/{DATA}/main/train.jsonl"
    local = hub.local_path(data, "task.files.train", hub.FILE)
    assert local.endswith(f"/snapshots/{_commit(f'dataset/{DATA}')}/main/train.jsonl")
    assert json.loads(open(local).readline()) == _rows()[0]
    # A file key reads a bare `org/name` as the relative path it may be.
    assert hub.local_path(DATA, "task.files.train", hub.FILE) == DATA


def test_local_paths_and_other_values_stay(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / MODEL).mkdir(parents=True)  # A local directory shaped like a Hub id wins.
    for value in (MODEL, str(tmp_path), "/no/such/dir", "./a/b", "self", "train_at_setup", ""):
        assert hub.local_path(value, "teacher.checkpoint") == value


@pytest.mark.parametrize(
    "value, kind, expected",
    [
        pytest.param(
            "tiny-org/missing",
            hub.REPO,
            "no such local path, and the model repository 'tiny-org/missing' is not in the "
            "Hugging Face cache",
            id="uncached",
        ),
        pytest.param(
            f"{MODEL}@v2", hub.REPO, f"model repository '{MODEL}' is not in the", id="revision"
        ),
        pytest.param(
            f"hf://datasets/{DATA}/main/test.jsonl",
            hub.FILE,
            f"{DATA}@main has no 'main/test.jsonl' in the Hugging Face cache",
            id="path_in_repo",
        ),
        pytest.param("hf://nope", hub.FILE, "Invalid HF URI", id="bad_uri"),
    ],
)
def test_names_that_do_not_resolve_fail_naming_key_and_name(offline, value, kind, expected):
    with pytest.raises(hub.HubError) as e:
        hub.local_path(value, "some.key", kind)
    assert str(e.value).startswith(f"some.key={value!r}: ") and expected in str(e.value)


def _http_error(cls, status: int):
    import httpx2  # huggingface_hub's HTTP client.

    request = httpx2.Request("GET", "https://huggingface.co/api/models/tiny-org/x")
    return cls("404 Client Error", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    "error, expected",
    [
        pytest.param(
            lambda: _http_error(huggingface_hub.errors.RepositoryNotFoundError, 404),
            "no such local path, and no model repository 'tiny-org/x' on the Hugging Face Hub",
            id="no_repository",
        ),
        pytest.param(
            lambda: _http_error(huggingface_hub.errors.RevisionNotFoundError, 404),
            "no revision 'v9' in the model repository 'tiny-org/x' on the Hugging Face Hub",
            id="no_revision",
        ),
        pytest.param(
            lambda: huggingface_hub.errors.LocalEntryNotFoundError("Connection refused"),
            "is not in the Hugging Face cache (",
            id="unreachable",
        ),
    ],
)
def test_online_failures_name_the_cause(monkeypatch, error, expected):
    """What huggingface_hub raises online (no network here: its download is replaced by one
    that raises) becomes one message naming the key, the name and the cause."""

    def download(*args, **kwargs):
        raise error()

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(hub.HubError) as e:
        hub.local_path("tiny-org/x@v9", "reward.model")
    assert str(e.value).startswith("reward.model='tiny-org/x@v9': ") and expected in str(e.value)
    assert "HF_HUB_OFFLINE" not in str(e.value)


def _math_config(arg):
    import importlib.util

    spec = importlib.util.spec_from_file_location("math_cfg", f"{ROOT}/configs/math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def _hub_math_config(checkpoint=MODEL):
    data = f"hf://datasets/{DATA}/main/train.jsonl"
    config = _math_config(f"checkpoint={checkpoint},train={data},test={data},smoke")
    config.steps, config.eval.every, config.checkpoint.every = 1, 1, 1
    config.reward.fn = "reward_fixtures:digits"  # A random model's completions: some reward.
    return config


def test_resolve_reads_local_paths_and_records_the_names(offline):
    config = _hub_math_config()
    run = rl.resolve(config)
    assert run.init.hf_checkpoint == hub.local_path(MODEL, "init.hf_checkpoint")
    assert os.path.isfile(run.task.files.train)
    recorded = run.to_dict()
    assert recorded["init"]["hf_checkpoint"] == MODEL
    assert recorded["task"]["files"]["train"] == config.task.files.train
    assert config.init.hf_checkpoint == MODEL  # The caller's config is not changed.


@pytest.mark.slow
def test_an_uncached_name_offline_is_one_error_line(offline, tmp_path):
    data = f"hf://datasets/{DATA}/main/train.jsonl"
    args = f"checkpoint=tiny-org/missing,train={data},test={data},smoke"
    r = subprocess.run(
        [sys.executable, "-m", "rlscale.main", "--config", f"configs/math.py:{args}"]
        + ["--workdir", str(tmp_path / "w")],
        cwd=ROOT,
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(offline)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert "init.hf_checkpoint='tiny-org/missing'" in errors[0], errors
    assert "HF_HUB_OFFLINE is set" in errors[0], errors


def test_the_commands_resolve_their_directory_flags(offline, tmp_path):
    """The commands read their checkpoint and model flags as Hub names too (before loading
    anything): a policy on the Hub needs a --workdir; an uncached reward model names its flag."""
    from rlscale import cli
    from rlscale.main import evaluate, train_reward_model

    config = f"--config={ROOT}/configs/quickstart.py:smoke"
    with pytest.raises(ValueError, match=f"--checkpoint={MODEL} is on the Hugging Face Hub: pass"):
        cli.call(evaluate.define_flags, evaluate.main, [config, f"--checkpoint={MODEL}"])
    args = [config, f"--checkpoint={tmp_path}", "--reward_model=tiny-org/rm"]
    with pytest.raises(hub.HubError, match="--reward_model='tiny-org/rm': no such local path"):
        cli.call(evaluate.define_flags, evaluate.main, args)
    args = ["--pairs=/p.jsonl", f"--out={tmp_path}/rm", "--init=tiny-org/policy"]
    with pytest.raises(hub.HubError, match="--init='tiny-org/policy': no such local path"):
        cli.call(train_reward_model.define_flags, train_reward_model.main, args)
