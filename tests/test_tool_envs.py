"""The tool task and its environment, the number-guessing game, and a gymnasium-style adapter:
the tasks' problems are deterministic with disjoint splits and exact verifiers; the tool
runs a block and replies with its output, an error line or a timeout (the sandbox's limits
end the call: the tests assert the status and the counters, never a duration); each
demonstration is what its environment would reply, and its text tokenizes, with the
tokenizer a run trains on the task's texts, into exactly the tokens of its policy turns and
replies tokenized apart, each turn ending with its stop's tokens."""

import inspect
import os
import re
import shutil
import subprocess
import types

import pytest

from rlscale import config_lib, sections, warm_start
from rlscale.data import tasks
from rlscale.data.tasks import Problem
from rlscale.envs import guess, python_tool
from rlscale.envs.protocol import Environment, Reply
from rlscale.rl import setup
from rlscale.tokenizers import train_sentencepiece

_UNSHARE = shutil.which("unshare")
HAVE_NAMESPACES = bool(_UNSHARE) and subprocess.run([_UNSHARE, "-rn", "true"]).returncode == 0
ISOLATION = "namespaces" if HAVE_NAMESPACES else "rlimits"


def tool(**kwargs):
    return python_tool.PythonTool(isolation=ISOLATION, **{"wall_seconds": 5.0, **kwargs})


def _operands(prompt):
    a, op, b, sign, c = re.fullmatch(r"Q: (\d+)(\*)(\d+)([+-])(\d+)=", prompt).groups()
    return int(a), int(b), sign, int(c)


# ------------------------------------------------------------------------------------------
# The tool task.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", [1, 5])
def test_tool_arithmetic_deterministic_disjoint_and_exact(difficulty):
    task = tasks.get("tool_arithmetic", difficulty)
    train = list(task.problems("train", 200))
    test = list(task.problems("test", 50))
    assert train == list(tasks.get("tool_arithmetic", difficulty).problems("train", 200))
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.prompt for p in train}) == 200
    for p in train + test:
        a, b, sign, c = _operands(p.prompt)
        assert {len(str(n)) for n in (a, b, c)} == {4 + difficulty}
        assert p.answer == str(a * b + c if sign == "+" else a * b - c)
        assert task.verify(p.demo, p) == 1.0
    other_seed = tasks.get("tool_arithmetic", difficulty, seed=1)
    assert not {p.prompt for p in train} & {p.prompt for p in other_seed.problems("train", 200)}


def test_tool_arithmetic_verifier_and_difficulty_bounds():
    task = tasks.get("tool_arithmetic", 1)
    p = tasks.Problem(prompt="Q: 12345*67890+11111=", answer="838113161", demo="")
    assert task.verify("Answer: 838113161", p) == 1.0
    assert task.verify(python_tool.tool_call("12345*67890+11111") + "Answer: 838113161", p) == 1
    assert task.verify("Answer: 838113160", p) == 0.0
    assert task.verify("output: 838113161\n", p) == 0.0  # The tool's reply is not an answer.
    assert task.verify("838113161", p) == 0.0
    assert task.extract_answer("x Answer: 838113161") == "838113161"
    with pytest.raises(ValueError, match=r"difficulty=6 must be in \[1, 5\] for 'tool_arithmetic'"):
        tasks.get("tool_arithmetic", 6)
    with pytest.raises(ValueError, match="tool_fraction=1.5 must be in"):
        tasks.ToolArithmetic(1, tool_fraction=1.5)


def test_tool_fraction_of_demos():
    """A demonstration calls the tool with probability `tool_fraction`, drawn after the
    problem's numbers: the problems are the same for every fraction."""
    n = 2000
    by_fraction = {
        f: list(tasks.ToolArithmetic(2, tool_fraction=f).problems("train", n))
        for f in (0.0, 0.3, 1.0)
    }
    prompts = [[p.prompt for p in ps] for ps in by_fraction.values()]
    assert prompts[0] == prompts[1] == prompts[2]
    called = {f: sum(python_tool.STOP in p.demo for p in ps) for f, ps in by_fraction.items()}
    assert called[0.0] == 0 and called[1.0] == n
    # Binomial(n, 0.3): 5 standard deviations is 0.051 of n.
    assert abs(called[0.3] / n - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5
    direct = [p for p in by_fraction[0.3] if python_tool.STOP not in p.demo]
    assert all(p.demo == f"Answer: {p.answer}" for p in direct)


def test_tool_demos_hold_the_environments_replies():
    """Each tool demonstration is its policy turn, what the environment replies to that turn
    (the code run in the sandbox), and the answer (`tasks.demo_turns`)."""
    task = tasks.ToolArithmetic(5, tool_fraction=1.0)
    env = tool()
    for p in task.problems("test", 4):
        env.reset(p)
        turns = tasks.demo_turns(task, p.demo)
        assert [by_env for _, by_env in turns] == [False, True, False]
        (turn, _), (reply, _), (answer, _) = turns
        step = env.step(turn)
        assert (step.text, step.done, step.reward) == (reply, False, None)
        assert step.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
        assert answer == f"Answer: {p.answer}"


def test_the_warm_start_trains_on_the_policys_turns_only():
    """The warm start's targets (`warm_start.demo_ids`): each turn of a demonstration
    tokenized on its own, as an episode tokenizes a reply and the policy writes its turns;
    the environment's replies are context, not targets. A single-turn demonstration is one
    turn, tokenized whole."""
    tool_task, guessing = tasks.ToolArithmetic(1, tool_fraction=1.0), tasks.NumberGuessing(1)
    demos = [p.demo for p in tool_task.problems("train", 20)]
    games = [p.demo for p in guessing.problems("train", 20)]
    tok = train_sentencepiece(demos + games, 300)
    for task, demo in ((tool_task, demos[0]), (guessing, games[0])):
        turns = tasks.demo_turns(task, demo)
        assert "".join(text for text, _ in turns) == demo
        ids, target = warm_start.demo_ids(tok, task, demo)
        want_ids, want_target = [], []
        for text, by_env in turns:
            want_ids += tok.encode(text)
            want_target += [not by_env] * len(tok.encode(text))
        assert (ids, target) == (want_ids + [tok.eos_id], want_target + [True])
    by_env = [by_env for _, by_env in tasks.demo_turns(guessing, games[0])]
    assert by_env == [False, True] * (len(by_env) // 2) and len(by_env) >= 2
    replies = [t for t, env in tasks.demo_turns(guessing, games[0]) if env]
    assert set(replies) <= {guess.HIGHER, guess.LOWER, guess.CORRECT}
    assert replies[-1] == guess.CORRECT
    single = next(tasks.Arithmetic(2).problems("train", 1)).demo
    ids, target = warm_start.demo_ids(tok, tasks.Arithmetic(2), single)
    assert ids == tok.encode(single, add_eos=True) and all(target)


# ------------------------------------------------------------------------------------------
# The Python tool.
# ------------------------------------------------------------------------------------------


def test_tool_replies_with_output_errors_and_timeouts():
    env = tool(cpu_seconds=1, wall_seconds=3.0)
    env.reset(None)
    ok = env.step("Let me compute.\n" + python_tool.tool_call("x = 6\nprint(x)\nx * 7"))
    assert ok.text == "output: 6\n42\n" and not ok.done and ok.reward is None
    assert ok.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    assert env.step(python_tool.tool_call("x = 1")).text == "output: (nothing printed)\n"
    assert env.step(python_tool.tool_call("'a' + 'b'")).text == "output: 'ab'\n"
    raised = env.step(python_tool.tool_call("print(1)\n1 // 0"))
    assert raised.text == "error: ZeroDivisionError: integer division or modulo by zero\n"
    assert raised.info == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 0}
    syntax = env.step(python_tool.tool_call("def f(:"))
    assert syntax.text.startswith("error: SyntaxError") and syntax.info["tool_errors"] == 1
    assert env.step(python_tool.tool_call("raise SystemExit(3)")).text == "error: exit status 3\n"
    loop = env.step(python_tool.tool_call("while True:\n    pass"))
    assert loop.text == "error: timeout\n" and not loop.done
    assert loop.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 1}
    none = env.step("no block here" + python_tool.STOP)
    assert none.text == "error: no code block\n" and none.info["tool_errors"] == 1


def test_tool_runs_the_last_block_and_cuts_long_output():
    env = tool(max_reply_chars=10)
    two_blocks = "```python\n1 + 1\n```\nthen\n```py\nx = '```'\nlen(x)" + python_tool.STOP
    assert python_tool.last_code(two_blocks) == "x = '```'\nlen(x)"
    assert env.step(two_blocks).text == "output: 3\n"
    assert python_tool.last_code("```python" + python_tool.STOP) == ""
    assert env.step(python_tool.tool_call("print('x' * 50)")).text == "output: xxxxxxxxxx...\n"
    long_error = env.step(python_tool.tool_call("raise ValueError('y' * 50)")).text
    assert long_error == "error: ValueError...\n"


def test_tool_limits_are_checked_at_once():
    with pytest.raises(sections.InvalidConfigError) as e:
        python_tool.PythonTool(max_reply_chars=0, wall_seconds=0, isolation="rlimits")
    assert e.value.problems == [
        "max_reply_chars=0 must be an integer >= 1",
        "tool.wall_seconds=0 must be > 0",
    ]


# ------------------------------------------------------------------------------------------
# The guessing game.
# ------------------------------------------------------------------------------------------


def _game(secret, high=16, tries=5):
    rules = guess.rules_text(guess.Rules(1, high, tries))
    return tasks.Problem(prompt=f"Q: game 00001: {rules}\n", answer=str(secret), demo="")


def _play(problem, strategy):
    """Plays `strategy(turn, low, high) -> guess` against the environment: (policy text,
    replies)."""
    env = guess.GuessNumber()
    env.reset(problem)
    low, high, text, replies = 1, guess.rules_of(problem.prompt).high, "", []
    while True:
        g = strategy(len(replies), low, high)
        reply = env.step(guess.guess_line(g))
        text += guess.guess_line(g)
        replies.append(reply)
        if reply.done:
            return text, replies
        low, high = (g + 1, high) if reply.text == guess.HIGHER else (low, g - 1)


def test_guess_replies_and_rewards():
    env = guess.GuessNumber()
    env.reset(_game(10))
    assert env.stops == ("?\n",)
    steps = [env.step(turn) for turn in ("8?\n", "I say 12?\n", "what?\n", "10?\n")]
    assert [s.text for s in steps] == ["higher\n", "lower\n", "say a number\n", "correct\n"]
    assert [(s.done, s.reward) for s in steps] == [(False, None)] * 3 + [(True, 1.0)]
    assert [s.info["invalid_guesses"] for s in steps] == [0, 0, 1, 0]
    env.reset(_game(10, tries=2))
    assert (env.step("3?\n").done, env.step("4?\n").reward) == (False, 0.0)  # Tries spent.


def test_guess_reward_credits_every_turn():
    """The reward comes only at the end and depends on every turn. On 1 to 16 in 5 tries:
    bisection wins all 16 games; the same bisection after two wasted guesses (1, then 2)
    finds 7 of the 14 numbers left within its 3 remaining tries, so wins 9; a scan that
    ignores the replies wins 5. The verifier, reading only the policy's turns, agrees with
    the environment's reward on every game."""
    games = [_game(s) for s in range(1, 17)]
    task = tasks.get("guess_number", 2)

    def bisect(turn, low, high):
        return (low + high) // 2

    def wasted_two(turn, low, high):
        return turn + 1 if turn < 2 else bisect(turn, low, high)

    def scan(turn, low, high):
        return low

    for strategy, wins in ((bisect, 16), (wasted_two, 9), (scan, 5)):
        results = [_play(g, strategy) for g in games]
        rewards = [replies[-1].reward for _, replies in results]
        assert sum(rewards) == wins
        assert rewards == [task.verify(text, g) for g, (text, _) in zip(games, results)]
        for _, replies in results:
            assert replies[-1].done and all(r.reward is None for r in replies[:-1])


def test_guess_number_task():
    task = tasks.get("guess_number", 2)
    train = list(task.problems("train", 300))
    test = list(task.problems("test", 50))
    assert train == list(tasks.get("guess_number", 2).problems("train", 300))
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert {guess.rules_of(p.prompt) for p in train} == {guess.Rules(1, 16, 5)}
    for p in train + test:
        assert task.verify(p.demo, p) == 1.0
        # The demonstration replays against the environment: its replies are the env's own.
        env = guess.GuessNumber()
        env.reset(p)
        lines = p.demo.splitlines(keepends=True)
        for turn, reply in zip(lines[::2], lines[1::2]):
            assert env.step(turn).text == reply
        assert lines[-1] == guess.CORRECT and len(lines) // 2 <= 5
    assert task.verify("1?\n2?\n3?\n4?\n5?\n", tasks.Problem(train[0].prompt, "6", "")) == 0.0
    assert task.verify("1?\n6?", tasks.Problem(train[0].prompt, "6", "")) == 1.0
    bisection = tasks.NumberGuessing(3, jitter=0.0)
    for p in bisection.problems("train", 50):
        guesses = guess.turn_guesses(p.demo)
        assert guesses[0] == 16 and len(guesses) <= 6


# ------------------------------------------------------------------------------------------
# Token boundaries, with the tokenizer a run trains on the task's texts.
# ------------------------------------------------------------------------------------------


def _run_tokenizer(name, difficulty, tmp_path):
    """The tokenizer a from-scratch run trains (`rl.setup`), on the quickstart's settings."""
    config = config_lib.rl_config()
    problems = list(tasks.get(name, difficulty).problems("train", config.task.n_train))
    task = types.SimpleNamespace(name=name)
    tokenizer_config = setup.TokenizerConfig(vocab_size=config.tokenizer.vocab_size)
    return setup._tokenizer(tokenizer_config, task, str(tmp_path), problems), problems


def _check_stop(tok, stop):
    ids = tok.encode(stop)
    assert 1 <= len(ids) <= 8 and tok.decode(ids) == stop


def _check_turns(tok, parts, stop):
    """The whole text encodes to its parts encoded apart; each turn ends with the stop's ids."""
    assert tok.encode("".join(parts)) == [i for part in parts for i in tok.encode(part)]
    for part in parts:
        if part.endswith(stop):
            assert tok.encode(part)[-len(tok.encode(stop)) :] == tok.encode(stop)


def test_tool_stop_and_replies_tokenize_at_the_turns(tmp_path):
    tok, problems = _run_tokenizer("tool_arithmetic", 2, tmp_path)
    _check_stop(tok, python_tool.STOP)
    demos = [p.demo for p in problems if python_tool.STOP in p.demo]
    assert len(demos) > 1000
    for demo in demos:
        turns = tasks.demo_turns(tasks.ToolArithmetic(2), demo)
        _check_turns(tok, [text for text, _ in turns], python_tool.STOP)
    turn = python_tool.tool_call("83712*90211-11023")
    for reply in (
        python_tool.error_reply("ZeroDivisionError: division by zero", 200),
        python_tool.error_reply("timeout", 200),
        python_tool.output_reply("", 200),
        python_tool.output_reply("'ab'\n[1, 2]\n", 200),
    ):
        _check_turns(tok, (turn, reply, "Answer: 5"), python_tool.STOP)


def test_guess_stop_and_replies_tokenize_at_the_turns(tmp_path):
    tok, problems = _run_tokenizer("guess_number", 3, tmp_path)
    _check_stop(tok, guess.STOP)
    for p in problems:
        turns = tasks.demo_turns(tasks.NumberGuessing(3), p.demo)
        assert [text for text, _ in turns] == p.demo.splitlines(keepends=True)
        _check_turns(tok, [text for text, _ in turns], guess.STOP)
    _check_turns(tok, ("7?\n", guess.INVALID, "12?\n", guess.LOWER, "3?\n"), guess.STOP)


# ------------------------------------------------------------------------------------------
# A gymnasium-style text environment, wrapped (docs/environments.md has the same adapter).
# ------------------------------------------------------------------------------------------


class LineWalk:
    """A stand-in with gymnasium's `Env` signatures: walk along a line of 8 cells to the goal
    with "left" and "right"; reward 1 on reaching it, truncated after 6 steps."""

    def reset(self, *, seed=None, options=None):
        del options
        self.pos, self.goal, self.steps = seed % 8, (seed * 5 + 3) % 8, 0
        return f"at {self.pos}, goal {self.goal}", {}

    def step(self, action):
        self.pos = max(0, min(7, self.pos + {"left": -1, "right": 1}.get(action, 0)))
        self.steps += 1
        terminated = self.pos == self.goal
        reward = 1.0 if terminated else 0.0
        return f"at {self.pos}", reward, terminated, self.steps >= 6, {"moved": 1}


class GymText(Environment):
    """A gymnasium-style text environment: a turn is one line (the action), the reply the
    next observation on a line of its own, the reward the episode's return."""

    stops = ("\n",)

    def __init__(self, make_env):
        self.env = make_env()

    def reset(self, problem):
        obs, _ = self.env.reset(seed=int(problem.answer))
        assert obs in problem.prompt, (obs, problem.prompt)
        self.total = 0.0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action.strip())
        self.total += float(reward)
        done = terminated or truncated
        numbers = {k: v for k, v in info.items() if isinstance(v, int | float)}
        return Reply(f"{obs}\n", done=done, reward=self.total if done else None, info=numbers)


def gym_problems(make_env, seeds):
    """A task's problems from an env: the prompt its first observation at the seed."""
    return [Problem(f"{make_env().reset(seed=s)[0]}\n", str(s), "") for s in seeds]


def test_gym_adapter():
    """The adapter of docs/environments.md (the same code) plays a stand-in's episodes."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "environments.md")) as f:
        page = f.read()
    for example in (GymText, gym_problems):
        assert inspect.getsource(example) in page
    problems = gym_problems(LineWalk, range(3))
    assert problems[1].prompt == "at 1, goal 0\n"
    env = GymText(LineWalk)
    env.reset(problems[1])
    reply = env.step("left\n")
    assert (reply.text, reply.done, reply.reward, reply.info) == ("at 0\n", True, 1.0, {"moved": 1})
    env.reset(problems[2])  # At 2, goal 5: wandering away runs out of steps.
    replies = [env.step("left\n") for _ in range(6)]
    assert [r.done for r in replies] == [False] * 5 + [True]
    assert replies[-1].reward == 0.0 and all(r.reward is None for r in replies[:-1])
    env.reset(problems[2])
    assert [env.step("right\n").reward for _ in range(3)] == [None, None, 1.0]
