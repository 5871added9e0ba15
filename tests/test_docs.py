"""The README and docs/ stay true to the code: every relative link resolves (a `#anchor` to a
heading of its page), and every command in a shell block names a module or script that exists,
a config (and variant) that loads, config keys that exist and flags the command defines.

A command's flags are the ones its `define_flags(fv, argv)` defines on fresh flags (every
command and tool follows `rlscale.cli`'s pattern), so nothing runs but the definitions.
"""

import functools
import glob
import importlib.util
import os
import re
import shlex
import urllib.parse

import pytest
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pages whose shell blocks are checked, and pages whose links are checked.
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]
LINKED = PAGES + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(f"{ROOT}/experiments/**/*.md", recursive=True)
    if os.path.basename(p) == "README.md"
)
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")

# Flags every absl command has (absl.app and absl.logging define them).
ABSL_FLAGS = {
    "help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "only_check_args",
    "pdb", "pdb_post_mortem", "run_with_pdb", "run_with_profiling", "profile_file",
    "use_cprofile_for_profiling", "logtostderr", "alsologtostderr", "log_dir", "verbosity",
    "v", "logger_levels", "stderrthreshold", "showprefixforinfo",
}  # fmt: skip


def _read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _split_fences(text):
    """(prose lines with fenced blocks blanked, [(language, first line number, lines)])."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", line)
        if block is None and fence:
            block = (fence.group(1), fence.group(2).lower(), number + 1, [])
            prose.append("")
        elif block is not None and line.strip().startswith(block[0]):
            blocks.append(block[1:])
            block = None
            prose.append("")
        elif block is not None:
            block[3].append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def _slug(heading):
    """GitHub's anchor for a heading: links reduced to their text, lowercased, punctuation
    dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def _anchors(page):
    prose, _ = _split_fences(_read(page))
    anchors, seen = set(), {}
    for line in prose:
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        anchors.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return anchors


def _links(page):
    prose, _ = _split_fences(_read(page))
    for number, line in enumerate(prose, 1):
        line = re.sub(r"`[^`]*`", "", line)  # Code spans hold no links.
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            yield number, target


@pytest.mark.parametrize("page", LINKED)
def test_relative_links_resolve(page):
    problems = []
    for number, target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path, _, anchor = urllib.parse.unquote(target).partition("#")
        base = os.path.join(ROOT, os.path.dirname(page))
        resolved = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, page)
        where = f"{page}:{number}: ({target})"
        if not os.path.exists(resolved):
            problems.append(f"{where}: no such file {os.path.relpath(resolved, ROOT)}")
        elif anchor and resolved.endswith(".md"):
            if anchor not in _anchors(os.path.relpath(resolved, ROOT)):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


# ---- commands ----------------------------------------------------------------------------


def _logical_lines(lines, first):
    """Shell lines with continuations joined, heredoc bodies and `$ ` prompts dropped."""
    out, pending, start, heredoc = [], "", first, None
    for number, line in enumerate(lines, first):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if not pending:
            start = number
            line = re.sub(r"^\s*\$\s+", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = pending + line
        pending = ""
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        if marker:
            heredoc = marker.group(1)
        out.append((start, text))
    if pending:
        out.append((start, pending))
    return out


def _commands():
    """(page, line, tokens): each `python -m rlscale...` or `python tools/...` invocation in a
    shell block of the README or a docs page, tokens after the program."""
    found = []
    for page in PAGES:
        for language, first, lines in _split_fences(_read(page))[1]:
            if language not in SHELL_LANGUAGES:
                continue
            for number, text in _logical_lines(lines, first):
                try:
                    tokens = shlex.split(text, comments=True)
                except ValueError as e:
                    found.append((page, number, ["<unparsable>", str(e)]))
                    continue
                for i, token in enumerate(tokens):
                    if os.path.basename(token) not in ("python", "python3"):
                        continue
                    rest = tokens[i + 1 :]
                    end = next(
                        (j for j, t in enumerate(rest) if t in ("&&", "||", ";", "|&")), len(rest)
                    )
                    rest = rest[:end]
                    if rest[:1] == ["-m"] and rest[1:2] and rest[1].startswith("rlscale"):
                        found.append((page, number, rest[1:]))
                    elif rest[:1] and rest[0].startswith("tools/"):
                        found.append((page, number, rest))
    return found


COMMANDS = _commands()


def _program(program):
    """(the file a `-m` module or a tools/ script runs, its module name) or (None, None)."""
    if program.startswith("tools/"):
        path = os.path.join(ROOT, program)
        return (
            (path, "docs_" + re.sub(r"\W", "_", program)) if os.path.isfile(path) else (None, None)
        )
    base = os.path.join(ROOT, *program.split("."))
    if os.path.isfile(base + ".py"):
        return base + ".py", program
    if os.path.isfile(os.path.join(base, "__main__.py")):  # `python -m rlscale.main`: train.
        return os.path.join(base, "__main__.py"), f"{program}.train"
    return None, None


@functools.cache
def _flags(program):
    """The flags the command defines: its `define_flags(fv, argv)` run on fresh flags (every
    command and tool follows `rlscale.cli`'s pattern)."""
    path, name = _program(program)
    if program.startswith("tools/"):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(name)
    fv = flags.FlagValues()
    module.define_flags(fv, ["docs"])
    return set(fv)


@functools.cache
def _config(spec):
    """The ConfigDict `--config spec` loads, or the reason it does not."""
    path, _, variant = spec.partition(":")
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return f"no such config file {path}"
    name = "docs_config_" + re.sub(r"\W", "_", path)
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        return module.get_config(variant or None)
    except Exception as e:  # A config that does not load: the doc is wrong.
        return f"{spec}: get_config({variant or None!r}) raised {type(e).__name__}: {e}"


def _key_problem(config, key):
    node = config
    for i, part in enumerate(key.split(".")):
        if not hasattr(node, "keys") or part not in node.keys():
            return f"no config key {'.'.join(key.split('.')[: i + 1])!r}"
        node = node[part]
    return None


def _arguments(tokens):
    """[(flag, value or None)] of a command's tokens, `[optional]` brackets and `...` dropped."""
    cleaned = [t.strip("[]") for t in tokens]
    cleaned = [t for t in cleaned if t and t not in ("|", "...")]
    out = []
    for i, token in enumerate(cleaned):
        if not token.startswith("--") or token == "--":
            continue
        name, eq, value = token[2:].partition("=")
        if not eq:
            following = cleaned[i + 1] if i + 1 < len(cleaned) else None
            value = following if following and not following.startswith("-") else None
        out.append((name, value))
    return out


@pytest.mark.parametrize(
    "page,line,tokens", COMMANDS, ids=[f"{p}:{n}:{t[0]}" for p, n, t in COMMANDS]
)
def test_documented_command_exists(page, line, tokens):
    program = tokens[0]
    assert program != "<unparsable>", f"{page}:{line}: the shell line does not parse: {tokens[1]}"
    assert _program(program)[0], f"{page}:{line}: no module or script {program}"
    defined = _flags(program)
    problems = []
    arguments = _arguments(tokens[1:])
    spec = next((v for k, v in arguments if k == "config"), None)
    config = _config(spec) if spec else None
    if isinstance(config, str):
        problems.append(config)
        config = None
    for name, value in arguments:
        if name.startswith("config."):
            if "config" not in defined:
                problems.append(f"--{name}: {program} takes no --config")
            elif config is None and spec is None:
                problems.append(f"--{name} without --config")
            elif config is not None and (p := _key_problem(config, name.split(".", 1)[1])):
                problems.append(f"--{name}: {p} in {spec}")
            continue
        known = defined | ABSL_FLAGS
        if name not in known and not (name.startswith("no") and name[2:] in defined):
            problems.append(f"--{name}: {program} defines no such flag")
        if config is not None and value and name in ("set", "grid"):
            for item in value.split(";"):
                key = item.partition("=")[0].strip()
                if key and (p := _key_problem(config, key)):
                    problems.append(f"--{name} {item}: {p} in {spec}")
    assert not problems, f"{page}:{line}: " + "; ".join(problems)


def test_commands_are_found():
    """The scan sees the documented commands (a broken fence would hide them all)."""
    programs = {t[0] for _, _, t in COMMANDS}
    assert {"rlscale.main", "tools/bench.py", "tools/fit_scaling.py"} <= programs, programs
