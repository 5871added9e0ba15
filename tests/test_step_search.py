"""Step search (`rlscale.eval.step_search`): PRM-guided beam search over a policy's steps.

A scripted environment with a known right path: the prompt `bad D, S steps:` asks for S
steps `d=d=...=d` (one digit each), right when none is D nor 0; a step "0" ends the solution
early (a wrong answer the PRM may still like). A scripted policy writes the digit of step t
in row j by a rule (j: the row's index among the call's rows with the same prompt, the rows
a real sampler draws with different keys) and stops as the real sampler stops: at the first
stop token (kept), or at max_new_tokens. A scripted PRM gives each step a logit from the
digits so far. Against it: the search finds what one sample misses; W = E = 1 is one
solution sampled step by step (and cut at the budget as one sample is); a plain-Python beam
search over the strings (an independent re-derivation) gives the same answers, scores and
token counts for several widths and aggregations; two small searches by hand. Then the
delimiter's stop tokens, the `--step_search` flag's errors, and `rlscale.main.evaluate
--step_search` end to end on the suite's warm start with a PRM trained for 2 steps.
"""

import collections
import dataclasses
import math
import re
from typing import NamedTuple

import jax
import numpy as np
import pytest
from conftest import ROOT, untrained_prm

from rlscale import cli, saved_policy
from rlscale.eval import best_of_n, harness, step_search
from rlscale.reward_models import prm as prm_lib
from rlscale.reward_models import step_labels
from rlscale.sampling import SamplingConfig
from rlscale.sampling.sampler import SampleOutput
from rlscale.sampling.scoring import completions_text
from rlscale.tokenizers import chat, train_sentencepiece

PROMPT_RE = re.compile(r"bad (\d), (\d) steps:(.*)$", re.S)


# ---- the scripted environment -------------------------------------------------------------


class Problem(NamedTuple):
    prompt: str
    bad: str
    steps: int


def problem(bad: str, steps: int) -> Problem:
    return Problem(f"bad {bad}, {steps} steps:", bad, steps)


def verify(text: str, p: Problem) -> float:
    digits = text.split("=")
    ok = len(digits) == p.steps and all(len(d) == 1 and d.isdigit() for d in digits)
    return float(ok and p.bad not in digits and "0" not in digits)


@pytest.fixture(scope="module")
def tok():
    """Characters as tokens: "=" is one token (and the byte piece <0x3D> a second), "=>" two."""
    corpus = ["bad 3, 4 steps:5=3=5=1", "bad 7, 2 steps:0=9=8=2=4=6"]
    return train_sentencepiece(corpus, 300, model_type="char", hard_vocab_limit=False)


class ScriptedPolicy:
    """A stand-in for `Sampler` (the interface `sample_and_score` uses). For each prompt
    `bad D, S steps:PREFIX` and each of its rows, writes the steps still missing, step t's
    digit `rule(D, j, t)` for the row's index j among the call's rows with this prompt, "="
    between steps and the EOS after the last (or after a "0"); then keeps the tokens up to the
    first of `cfg.stop_tokens` (included) and at most `cfg.max_new_tokens`."""

    layout = None

    def __init__(self, tok, rule):
        self.tok, self.rule = tok, rule
        self.calls = []  # (decoded prompts, cfg) of every call.

    def __call__(self, params, prompts, rng, cfg):
        del params, rng
        texts = [self.tok.decode(ids) for ids in prompts]
        self.calls.append((texts, cfg))
        seen, rows = collections.Counter(), []
        for text in texts:
            bad, steps, prefix = PROMPT_RE.match(text).groups()
            for _ in range(cfg.num_samples):
                j, seen[text] = seen[text], seen[text] + 1
                digits = []
                for t in range(prefix.count("="), int(steps)):
                    digits.append(self.rule(bad, j, t))
                    if digits[-1] == "0":
                        break
                ids = [*self.tok.encode("=".join(digits)), self.tok.eos_id]
                stop = [i for i, t in enumerate(ids) if t in cfg.stop_tokens]
                rows.append(ids[: min(stop[0] + 1 if stop else len(ids), cfg.max_new_tokens)])
        N, M = len(rows), cfg.max_new_tokens
        tokens = np.full((N, M), cfg.pad_id, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        lengths = np.array([len(r) for r in rows], np.int32)
        mask = np.arange(M)[None] < lengths[:, None]
        truncated = np.array([r[-1] not in cfg.stop_tokens for r in rows])
        P = max(map(len, prompts))
        prompt_mask = np.arange(P)[None] >= P - np.array([len(p) for p in prompts])[:, None]
        return SampleOutput(
            tokens,
            mask,
            np.zeros((N, M), np.float32),
            lengths,
            truncated,
            np.zeros((N, M), bool),
            np.zeros(N, bool),
            np.repeat(np.arange(len(prompts)), cfg.num_samples),
            np.zeros((len(prompts), P), np.int32),
            prompt_mask,
        )


class ScriptedPRM:
    """A stand-in for `ProcessRewardModel`: step j of a row gets `logit(D, digits)`, the
    digits of the completion's steps through j (`step_labels.completion_steps` at "=")."""

    def __init__(self, tok, logit, delimiter="="):
        self.tokenizer, self.logit = tok, logit
        self.config = prm_lib.PRMConfig(delimiter=delimiter)

    def with_bucket(self, tokens):
        return self

    def score_steps(self, prompt_ids, completion_ids):
        steps = [step_labels.completion_steps(self.tokenizer, c, "=") for c in completion_ids]
        S = max(s.num_steps for s in steps)
        scores, mask = np.zeros((len(steps), S), np.float32), np.zeros((len(steps), S), bool)
        for i, (p, c, s) in enumerate(zip(prompt_ids, completion_ids, steps)):
            bad = PROMPT_RE.match(self.tokenizer.decode(p)).group(1)
            text = self.tokenizer.decode([t for t in c if t != self.tokenizer.eos_id])
            for j, end in enumerate(s.ends):
                digits = [d for d in text[:end].split("=") if d]
                scores[i, j], mask[i, j] = self.logit(bad, digits), True
        return scores, mask, steps


def clean_logit(bad, digits):
    """+3 while no step is the bad digit, -3 after."""
    return -3.0 if bad in digits else 3.0


def search(tok, rule, logit, problems, *, budget=32, **kw):
    policy = ScriptedPolicy(tok, rule)
    cfg = SamplingConfig(max_new_tokens=budget, stop_tokens=(tok.eos_id,))
    result = step_search.beam_search(
        policy, None, tok, problems, verify, ScriptedPRM(tok, logit), cfg=cfg,
        rng=jax.random.key(0), **kw,
    )  # fmt: skip
    return result, policy


PROBLEMS = [problem("3", 3), problem("7", 4), problem("2", 2)]


def test_the_search_finds_what_one_sample_misses(tok):
    """A policy that writes a right step once in four rows (j = 3, 7, ...) and the bad digit
    otherwise: one sample per problem (W = E = 1) is wrong on every problem, and the search
    with E = 4, keeping the step the PRM likes, is right on every one."""

    def rule(bad, j, t):
        return "5" if j % 4 == 3 else bad

    one, _ = search(tok, rule, clean_logit, PROBLEMS, beam=1, expand=1)
    assert one.accuracy == 0.0 and one.texts == ["3=3=3", "7=7=7=7", "2=2"]
    found, policy = search(tok, rule, clean_logit, PROBLEMS, beam=1, expand=4)
    assert found.accuracy == 1.0 and found.texts == ["5=5=5", "5=5=5=5", "5=5"]
    np.testing.assert_array_equal(found.rewards_B, [1.0, 1.0, 1.0])
    np.testing.assert_allclose(found.scores_B, prm_lib.sigmoid(3.0))
    assert found.finished_B.all() and found.rounds == 4
    # Each row samples "d=" (2 tokens) or the last "d" and the EOS (2): 4 rows x 2 per step.
    np.testing.assert_array_equal(found.generated_tokens_B, [3 * 8, 4 * 8, 2 * 8])
    # One sampler call per round, on the same shapes: 3 problems x W = 1 prompts (padded
    # while fewer are unfinished), E = 4 samples each, stopping also at "=".
    assert len(policy.calls) == 4
    assert {(len(texts), cfg.num_samples) for texts, cfg in policy.calls} == {(3, 4)}
    assert set(policy.calls[0][1].stop_tokens) == {
        tok.eos_id,
        *step_search.step_stop_tokens(tok, "="),
    }
    assert policy.calls[1][0] == [p.prompt + "5=" for p in PROBLEMS]
    assert policy.calls[3][0] == [PROBLEMS[1].prompt + "5=5=5="] * 3  # Two padding rows.


def _digits(bad, j, t):
    """A deterministic jumble of digits, "0" (an early end) among them."""
    return "0123456789"[(7 * j + 3 * t + int(bad) * t * t + 1) % 10]


def test_one_entry_one_expansion_is_one_solution_step_by_step(tok):
    """W = E = 1 samples one solution a step per round: the same text and as many tokens as
    the policy's one sample without the delimiter; cut at the budget as that sample is, the
    tokens sampled past the budget still counted."""
    problems = [problem("3", 4), problem("7", 3), problem("4", 2)]
    policy = ScriptedPolicy(tok, _digits)
    cfg = SamplingConfig(max_new_tokens=32, stop_tokens=(tok.eos_id,))
    out = policy(None, [chat.encode_prompt(tok, p.prompt) for p in problems], None, cfg)
    one_shot = completions_text(tok, out.tokens, out.lengths)
    result, calls = search(tok, _digits, clean_logit, problems, beam=1, expand=1)
    assert result.texts == one_shot and one_shot == ["1=7=9=7", "1=1=5", "1=8"]
    np.testing.assert_array_equal(result.generated_tokens_B, out.lengths)
    assert result.rounds == 4 and len(calls.calls) == 4
    # A budget of 5 tokens for "1=7=9=7" + EOS. One sample stops after 5; the search samples
    # "1=", "7=", then "9=" of which the budget keeps "9": the same text, 6 tokens sampled.
    cut, _ = search(tok, _digits, clean_logit, problems[:1], beam=1, expand=1, budget=5)
    cfg = SamplingConfig(max_new_tokens=5, stop_tokens=(tok.eos_id,))
    out = policy(None, [chat.encode_prompt(tok, problems[0].prompt)], None, cfg)
    assert cut.texts == completions_text(tok, out.tokens, out.lengths) == ["1=7=9"]
    assert cut.finished_B.tolist() == [True] and cut.generated_tokens_B.tolist() == [6]
    assert cut.rounds == 3 and cut.rewards_B.tolist() == [0.0]


# ---- a plain-Python beam search over strings --------------------------------------------------


def reference(p: Problem, beam, expand, rule, logit, aggregation):
    """The search re-derived on strings: (answer, its score, finished, tokens sampled).

    An entry is (text, finished, score). A step from a prefix with t steps is the digit
    rule(D, j, t) followed by "=" (2 tokens), or, last or "0", by the EOS (2 tokens)."""
    agg = {"last": lambda v: v[-1], "min": min, "product": math.prod}[aggregation]

    def score(text):
        digits = text.split("=")[: text.count("=") + (not text.endswith("="))]
        return agg([1 / (1 + math.exp(-logit(p.bad, digits[: i + 1]))) for i in range(len(digits))])

    beams, tokens = [("", False, None)] * beam, 0
    while any(not f for _, f, _ in beams):
        candidates, seen = [e for e in beams if e[1]], collections.Counter()
        for text, finished, _ in beams:
            if finished:
                continue
            for _ in range(expand):
                j, seen[text] = seen[text], seen[text] + 1
                d = rule(p.bad, j, text.count("="))
                done = d == "0" or text.count("=") + 1 == p.steps
                new = text + d + ("" if done else "=")
                candidates.append((new, done, score(new)))
                tokens += 2
        beams = sorted(candidates, key=lambda e: -e[2])[:beam]
    answer = beams[0]
    return answer[0], answer[2], tokens


@pytest.mark.parametrize(
    "beam, expand, aggregation",
    [(1, 1, "last"), (2, 3, "last"), (3, 2, "min"), (4, 4, "product"), (3, 1, "last")],
)
def test_matches_a_plain_python_beam_search(tok, beam, expand, aggregation):
    """Graded step logits (one per digit, summed) and a policy that sometimes ends early: every
    answer, its score, the verifier's reward and every problem's sampled tokens are the
    re-derivation's."""
    weight = dict(zip("0123456789", [1.2, 0.4, -0.3, 0.9, 0.1, 0.7, -0.8, 0.5, -0.2, 0.3]))

    def logit(bad, digits):
        return sum(weight[d] for d in digits) - 2.0 * digits.count(bad)

    problems = [problem("3", 4), problem("7", 3), problem("4", 5), problem("6", 2)]
    result, _ = search(
        tok, _digits, logit, problems, beam=beam, expand=expand, aggregation=aggregation
    )
    want = [reference(p, beam, expand, _digits, logit, aggregation) for p in problems]
    assert result.texts == [w[0] for w in want]
    np.testing.assert_allclose(result.scores_B, [w[1] for w in want], rtol=1e-6)
    np.testing.assert_array_equal(result.generated_tokens_B, [w[2] for w in want])
    np.testing.assert_array_equal(
        result.rewards_B, [verify(w[0], p) for w, p in zip(want, problems)]
    )
    assert result.finished_B.all()
    assert result.accuracy == np.mean(result.rewards_B > 0)


# ---- two searches by hand ---------------------------------------------------------------------

# `bad 3, 2 steps:` with W = 2, E = 2. Round 0 samples rows j = 0..3 of two copies of the
# prompt: "1=", "3=", "0" (finished), "2="; round 1 continues each kept prefix with rows
# j = 0, 1: "4", "3" (finished: the second step is the last). Logits by text, "last":
HAND = {"1": 1.0, "3": -2.0, "2": 2.0, "2=4": 0.0, "2=3": -1.0, "1=4": 3.0, "1=3": -3.0}


def _hand_rule(bad, j, t):
    return "1302"[j] if t == 0 else "43"[j % 2]


@pytest.mark.parametrize(
    "zero, answer, tokens",
    [
        # Round 0 keeps "2=" (2.0) and "1=" (1.0), not "0" (0.5); round 1's candidates are
        # "2=4" (0.0), "2=3", "1=4" (3.0), "1=3": the answer is "1=4", below "2=" at step 1.
        # Sampled: 4 rows x 2 tokens, then 4 x ("4" or "3", EOS).
        (0.5, "1=4", 16),
        # "0" (1.5) now beats "1=": kept, finished. Round 1 continues "2=" alone: "2=4"
        # (0.0), "2=3" (-1.0); the finished "0" competes and wins. 8 + 2 x 2 tokens.
        (1.5, "0", 12),
    ],
)
def test_two_searches_by_hand(tok, zero, answer, tokens):
    logits = {**HAND, "0": zero}
    result, _ = search(
        tok, _hand_rule, lambda bad, d: logits["=".join(d)], [problem("3", 2)], beam=2, expand=2
    )
    assert result.texts == [answer] and result.rounds == 2
    assert result.scores_B[0] == pytest.approx(prm_lib.sigmoid(logits[answer]))
    assert result.generated_tokens_B.tolist() == [tokens]
    assert result.rewards_B.tolist() == [verify(answer, problem("3", 2))]


@pytest.mark.parametrize(
    "zero, answer, finished",
    [(1.5, "0", True), (0.5, "2=", False)],  # After round 0 of the searches above.
)
def test_after_max_steps_the_answer_is_the_best_finished_entry(tok, zero, answer, finished):
    """Stopped after one round: the finished "0" (1.5) is the answer although "2=" (2.0)
    scores higher; with no finished entry kept, the best unfinished one is."""
    logits = {**HAND, "0": zero}
    result, _ = search(
        tok, _hand_rule, lambda bad, d: logits["=".join(d)], [problem("3", 2)], beam=2,
        expand=2, max_steps=1,
    )  # fmt: skip
    assert (result.texts, result.finished_B.tolist(), result.rounds) == ([answer], [finished], 1)
    assert result.scores_B[0] == pytest.approx(prm_lib.sigmoid(logits[answer.rstrip("=")]))


# ---- the delimiter, the flag --------------------------------------------------------------------


def test_the_delimiter_stops_at_each_token_ending_with_it(tok):
    """ "=" is the learned piece and the byte piece <0x3D>: both end a step, nothing else does;
    a delimiter of two tokens is an error naming it, before anything is sampled."""
    stops = step_search.step_stop_tokens(tok, "=")
    assert stops == (tok.token_id("<0x3D>"), tok.token_id("="))
    policy = ScriptedPolicy(tok, _digits)
    with pytest.raises(ValueError) as e:
        step_search.beam_search(
            policy, None, tok, PROBLEMS, verify, ScriptedPRM(tok, clean_logit, "=>"),
            beam=2, expand=2, cfg=SamplingConfig(stop_tokens=(tok.eos_id,)),
            rng=jax.random.key(0),
        )  # fmt: skip
    assert str(e.value).startswith(
        f"step delimiter '=>' is not one token of the tokenizer (it encodes to 2 tokens "
        f"{tok.encode('=>')}): step search stops sampling a step at a token"
    )
    assert not policy.calls


QUICKSTART = f"{ROOT}/configs/quickstart.py"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"step_search": "4,4"}, "--step_search=4,4 needs --prm DIR: the process reward model "
         "that scores each step"),
        (
            {"step_search": "4", "prm_dir": "/p"},
            "--step_search=4: expected BEAM,EXPAND, two integers >= 1 (e.g. 4,4: keep 4 partial "
            "solutions per problem, continue each 4 ways per step)",
        ),
        ({"step_search": ["4", "x"], "prm_dir": "/p"}, "--step_search=4,x: expected BEAM,"),
        ({"step_search": "0,2", "prm_dir": "/p"}, "--step_search=0,2: expected BEAM,"),
        (
            {"step_search": "2,2", "prm_dir": "/p", "step_search_aggregation": "mean"},
            "--step_search_aggregation='mean' is not one of min, last, product",
        ),
    ],
)  # fmt: skip
def test_bad_step_search_flags_fail_before_anything_loads(tmp_path, flags, message):
    """Checked with the other test-time flags, before the (missing) checkpoint is read."""
    config = cli.load_config(f"{QUICKSTART}:smoke")
    with pytest.raises(ValueError) as e:
        harness.run(saved_policy.resolve(config), str(tmp_path / "nosuch"), k=4, n=2, **flags)
    assert str(e.value).startswith(message)


def test_step_search_flag_errors_are_one_line(tmp_path, capsys):
    """Through the command's guard, a mistake is one `error:` line; --prm with --step_search
    alone (no --best_of, no --scorer=prm) is no mistake."""
    config = cli.load_config(f"{QUICKSTART}:smoke")
    with pytest.raises(SystemExit):
        cli.guard(harness.run)(
            saved_policy.resolve(config), str(tmp_path), k=2, n=2, step_search="2,2"
        )
    assert capsys.readouterr().err == (
        "error: --step_search=2,2 needs --prm DIR: the process reward model that scores each step\n"
    )
    assert (
        best_of_n.check_test_time_flags(None, 2, ["logprob"], None, None, "/p", ["min"], "2,2")
        is None
    )


# ---- end to end on the warm start ------------------------------------------------------------


@pytest.fixture(scope="module")
def prm_dir(warm, tmp_path_factory):
    return untrained_prm(warm, str(tmp_path_factory.mktemp("prm") / "prm"), seq_len=64)


def test_evaluate_step_search_on_the_warm_start(warm, prm_dir, tmp_path):
    """`harness.run(..., step_search="1,1")` next to best-of-N: the report's answers are the
    task's verdicts on its texts, and the search is the sampler run a step at a time by hand:
    prompt + prefix, stopping at "=" or the EOS, all problems per call, round r with
    fold_in(key, r), cut at max_new_tokens; the same texts and sampled tokens."""
    config = cli.load_config(f"{QUICKSTART}:smoke", ["--config.mesh.shape=(1,1,1)"])
    config.reward.workers = 0
    config = saved_policy.resolve(config)
    n, seed = 3, 0
    report = harness.run(
        config, str(warm / "final"), k=2, n=n, best_of=[1, 2], scorers=["logprob"],
        prm_dir=prm_dir, step_search="1,1", output=str(tmp_path / "eval.json"),
        plot=str(tmp_path / "curves.png"), seed=seed,
    )  # fmt: skip
    s = report["step_search"]
    task, problems = saved_policy.load_problems(config.task, str(warm), "test", n)
    texts, rewards = s["per_problem"]["texts"], s["per_problem"]["rewards"]
    assert rewards == [task.verify(t, p) for t, p in zip(texts, problems)]
    assert s["accuracy"] == np.mean(np.array(rewards) > 0)
    assert (s["name"], s["finished_frac"]) == ("step_search(beam=1, expand=1, prm_last)", 1.0)
    assert s["best_of"]["N"] == [1, 2] and "best_of/logprob" in s["best_of"]
    length = report["metrics"]["response_length"]
    assert s["best_of"]["generated_tokens_per_problem"] == pytest.approx([length, 2 * length])
    table = step_search.table(s).splitlines()
    assert table[0].startswith("  step_search(beam=1, expand=1, prm_last): accuracy ")
    assert table[2].split() == ["N", "tokens", "best_of/logprob"] and len(table) == 5

    policy = saved_policy.load_policy(config.mesh, str(warm / "final"), str(warm))
    tok = policy.tokenizer
    cfg = saved_policy.sampling_config(config.sampling, config.task, tok, 1)
    # "=" ends a step as the learned piece or as the byte piece <0x3D>.
    delimiter_ids = (tok.token_id("<0x3D>"), tok.token_id("="))
    assert step_search.step_stop_tokens(tok, "=") == delimiter_ids
    step_cfg = dataclasses.replace(cfg, stop_tokens=(*cfg.stop_tokens, *delimiter_ids))
    rng = jax.random.fold_in(jax.random.key(seed), 1)  # What evaluate gives the search.
    ids, done, sampled, r = [[] for _ in problems], [False] * n, [0] * n, 0
    while not all(done):
        live = [b for b in range(n) if not done[b]]
        prompts = [
            problems[b].prompt + tok.decode([t for t in ids[b] if t != tok.eos_id]) for b in live
        ]
        prompts += prompts[:1] * (n - len(live))
        encoded = [chat.encode_prompt(tok, x) for x in prompts]
        out = policy.sampler(policy.params, encoded, jax.random.fold_in(rng, r), step_cfg)
        r += 1
        for row, b in enumerate(live):
            new = np.asarray(out.tokens)[row, : int(out.lengths[row])].tolist()
            sampled[b] += len(new)
            ids[b] += new[: cfg.max_new_tokens - len(ids[b])]
            done[b] = ids[b][-1] in cfg.stop_tokens or len(ids[b]) >= cfg.max_new_tokens
    assert texts == [tok.decode([t for t in x if t != tok.eos_id]) for x in ids]
    assert s["per_problem"]["generated_tokens"] == sampled and s["rounds"] == r
    assert r > 1 and any("=" in t[:-1] for t in texts)  # Sampling did stop at "=".
