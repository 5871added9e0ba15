"""The library's shape, read from its source with `ast`: no import cycle between its modules
(a function-level import counts, so none can dodge one), the library never imports a command
(`rlscale.main`), a config, an experiment or a tool, and no module passes 600 lines nor any
function 80 (docstrings included; the default config's data aside)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, "rlscale")
COMMANDS = "rlscale.main"
# Data, not logic: the default config, one dict per section.
LONG_FUNCTIONS_ALLOWED = {("rlscale.config_lib", "rl_config")}


def _modules():
    """{module name: parsed source} of every file under rlscale/."""
    out = {}
    for d, _, files in os.walk(LIBRARY):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                name = name.removesuffix(".__init__")
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                out[name] = (text, ast.parse(text))
    return out


MODULES = _modules()


def _imports(tree, name):
    """Every module this one imports, at any depth of its code (names of rlscale's modules
    where they are)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: -node.level]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:  # `from package import module` imports the module.
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return found


def _graph():
    return {
        name: {m for m in _imports(tree, name) if m in MODULES and m != name}
        for name, (_, tree) in MODULES.items()
    }


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(v, path):
        state[v] = "open"
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w, [*path, w])):
                return found
        state[v] = "done"
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v, [v])):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_library_imports_no_command_config_or_tool():
    bad = []
    for name, (_, tree) in MODULES.items():
        if name.startswith(COMMANDS):
            continue
        for m in _imports(tree, name):
            if m.startswith((COMMANDS, "configs", "experiments", "tools")):
                bad.append(f"{name} imports {m}")
    assert not bad, bad


def test_modules_and_functions_stay_small():
    long_modules = [
        f"{name}: {text.count(chr(10))} lines"
        for name, (text, _) in MODULES.items()
        if text.count("\n") > 600
    ]
    long_functions = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, (_, tree) in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
        and (name, node.name) not in LONG_FUNCTIONS_ALLOWED
    ]
    assert not long_modules and not long_functions, long_modules + long_functions
