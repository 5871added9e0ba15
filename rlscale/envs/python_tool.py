"""The Python tool as an environment (`PythonTool`): a policy's turn ends with a fenced code
block, the environment runs the block's code in the sandbox (`sandbox.run_python`) and replies
with what it printed, and the policy writes on. It owns the tool's text formats (the fence,
the stop, the replies), which the tool task's demonstrations reuse (`data.tasks`), so a
demonstration holds the replies exactly as the environment writes them.

    policy:  ```python\\n12345*67890+11111\\n```\\n        (the turn ends at `STOP`)
    reply:   output: 838113161\\n
    policy:  Answer: 838113161

The code runs as a notebook cell: what it prints, then the `repr` of its last line when that
line is an expression whose value is not None (as Python's interactive prompt shows it).

Why these formats (docs/environments.md, "Token boundaries", has the argument): a reply is
tokenized apart from the policy's turn, and a stop is matched on token ids, so each must sit at
a boundary that the task's SentencePiece tokenizer never merges across. Its pieces never join
a Latin letter to punctuation or a newline, nor a digit to anything: so the stop (newline,
closing fence, newline) begins after the code's last character, a digit in the task's
demonstrations (a bare expression, no `print(...)`, whose `)` the tokenizer merges with the
fence: `)\\n```\\n` is one piece of the quickstart's tokenizer), and the reply begins with a
letter (`output`, `error`) after the stop's newline and ends with a newline before the
policy's next word.
"""

import re

from rlscale import sections
from rlscale.envs import sandbox
from rlscale.envs.protocol import Environment, Reply

FENCE = "```"
OPEN = FENCE + "python\n"  # How the task's demonstrations open a block (any info string runs).
STOP = "\n" + FENCE + "\n"  # The closing fence on its own line ends the policy's turn.
OUTPUT, ERROR = "output: ", "error: "
NOTHING_PRINTED = "(nothing printed)"
CUT = "..."
MAX_REPLY_CHARS = 200  # `PythonTool`'s default bound on a reply's output.

# An opening fence: backticks at the start of a line, an info string without backticks.
_OPENING_RE = re.compile(r"(?:^|\n)```[^`\n]*\n")

# The program a block runs as: the block's statements, then its last expression's repr (a
# notebook cell). Tracebacks end with the block's own exception line, which the reply shows.
_CELL = """import ast
source = {source!r}
tree = ast.parse(source, "<cell>")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile(tree, "<cell>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


def tool_call(code: str) -> str:
    """The policy's text of a call: `code` in a python block, up to and with the stop."""
    return OPEN + code + STOP


def last_code(action: str) -> str | None:
    """The code of the last fenced block of a turn ending with `STOP`, or None without one."""
    body = (action[: -len(STOP)] if action.endswith(STOP) else action) + "\n"
    openings = list(_OPENING_RE.finditer(body))
    return body[openings[-1].end() : -1] if openings else None


def cell_program(code: str) -> str:
    """The program `run_python` runs for a block: `code` as a notebook cell."""
    return _CELL.format(source=code)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + CUT


def output_reply(stdout: str, max_chars: int) -> str:
    """The reply to a call that ran to the end: its output (trailing whitespace removed, cut
    to `max_chars` characters), on a line that starts with `OUTPUT` and ends with a newline."""
    body = stdout.rstrip()
    return OUTPUT + (_cut(body, max_chars) if body else NOTHING_PRINTED) + "\n"


def error_reply(what: str, max_chars: int) -> str:
    """The reply to a call that failed: one line, `ERROR` and what went wrong."""
    return ERROR + _cut(" ".join(what.split()), max_chars) + "\n"


def reply_text(result: sandbox.ExecResult, max_chars: int) -> str:
    """The reply to a call: its output, or one error line (the exception's last line of the
    traceback, `timeout`, `out of memory`, `too much output`, `killed`)."""
    if result.status == sandbox.OK:
        return output_reply(result.stdout, max_chars)
    if result.status == sandbox.ERROR:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return error_reply(lines[-1] if lines else f"exit status {result.exit_code}", max_chars)
    what = {
        sandbox.TIMEOUT: "timeout",
        sandbox.MEMORY: "out of memory",
        sandbox.OUTPUT_LIMIT: "too much output",
        sandbox.KILLED: "killed",
    }[result.status]
    return error_reply(what, max_chars)


class PythonTool(Environment):
    """Runs the code block that ends each policy turn and replies with its output.

    Each turn ending with `STOP` is one call: the code of its last block runs as a notebook
    cell (`cell_program`) under the sandbox's limits, and the reply is `reply_text`. The
    episode never ends here (`done=False`: the policy answers after, and the task's verifier
    grades the answer it states). `info` counts `tool_calls` (every turn), `tool_errors` (the
    code raised, exited nonzero, ran out of memory, printed too much or was killed, or the
    turn had no block) and `tool_timeouts`.

    Args:
      max_reply_chars: the most characters of output (or of an error line) a reply holds;
        longer ones are cut and end with `CUT`.
      **limits: `sandbox.SandboxLimits` fields (the `tool.` keys), for example
        `wall_seconds=2.0, isolation="rlimits"`; checked here with `max_reply_chars`, all
        at once (`sections.InvalidConfigError`).
    """

    stops = (STOP,)

    def __init__(self, max_reply_chars: int = MAX_REPLY_CHARS, **limits):
        with sections.deferred():
            self.limits = sandbox.SandboxLimits(**limits)
        problems = sections.at_least("max_reply_chars", max_reply_chars, 1)
        sections.raise_if(problems + self.limits.problems())
        self.max_reply_chars = max_reply_chars

    def reset(self, problem) -> None:
        del problem  # Every call is independent: no state carries from one turn to the next.

    def step(self, action: str) -> Reply:
        code = last_code(action)
        if code is None:
            text, status = error_reply("no code block", self.max_reply_chars), sandbox.ERROR
        else:
            result = sandbox.run_python(cell_program(code), self.limits)
            text, status = reply_text(result, self.max_reply_chars), result.status
        info = {
            "tool_calls": 1,
            "tool_errors": int(status not in (sandbox.OK, sandbox.TIMEOUT)),
            "tool_timeouts": int(status == sandbox.TIMEOUT),
        }
        return Reply(text=text, info=info)
