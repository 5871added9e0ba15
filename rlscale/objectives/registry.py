"""The transform registry (name, stage, required and provided terms, `ByArg` choices) and the
objective a config names as one chain string: `parse`, `check` (every problem at once), `build`, and
the README's `table`. Chain syntax and stages: docs/objectives.md.
"""

import ast
import difflib
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

from rlscale.objectives.core import Transform, chain

STAGES = ("batch", "loss")
# Terms computed with a model pass; only those a chain requires are computed. The learner
# computes all but `teacher_logp`, the teacher's pass, which the rollout stage runs
# (`rl.rollouts.Teacher`) and the batch carries, as it carries the generator's `sampler_logp`.
# `moe_lb` and `moe_z`: a mixture-of-experts policy's auxiliary losses over the micro-batch.
MODEL_TERMS = (
    "logp",
    "entropy",
    "value",
    "old_logp",
    "old_value",
    "ref_logp",
    "teacher_logp",
    "moe_lb",
    "moe_z",
)
# Terms the run supplies to each stage (besides what earlier transforms provide).
BATCH_TERMS = (
    "reward",
    "correct",
    "mask",
    "row_weight",
    "sampler_logp",
    "old_logp",
    "old_value",
    "ref_logp",
    "teacher_logp",
    "step_reward",
    "step_mask",
)
LOSS_TERMS = BATCH_TERMS + ("logp", "entropy", "value", "update", "moe_lb", "moe_z")
# Keyword arguments the run injects into factories that accept them.
RUN_ARGS = ("group_size", "max_len")
AGGREGATION_TERMS = ("loss_sum", "denominator")


class ByArg(NamedTuple):
    """Required terms chosen by one argument of the factory: `terms[value]` for the value the
    transform is built with (a term name or a tuple of them). `register` fills in `default`,
    the factory's default for `arg`, which must be one of the listed values."""

    arg: str
    terms: dict[Any, str | tuple[str, ...]]
    default: Any = None

    def lists(self, value) -> bool:
        try:
            return value in self.terms
        except TypeError:  # An unhashable value (a list) is not listed.
            return False

    def get(self, value) -> tuple[str, ...]:
        """The terms for `value` (for one not listed, those of the default: the factory
        rejects such a value, and `check` reports that)."""
        return _as_terms(self.terms[value if self.lists(value) else self.default])

    def text(self) -> str:
        """E.g. `sampler_logp (old_logp if behaviour=trainer)`."""
        others = "; ".join(
            f"{' + '.join(_as_terms(t)) or 'nothing'} if {self.arg}={v}"
            for v, t in self.terms.items()
            if v != self.default
        )
        return f"{' + '.join(self.get(self.default)) or 'nothing'} ({others})"


class Entry(NamedTuple):
    name: str
    factory: Callable[..., Transform]
    stage: str
    requires: tuple[str | ByArg, ...]  # As declared; `required(kwargs)` resolves them.
    provides: tuple[str, ...]

    def required(self, kwargs: dict[str, Any] | None = None) -> tuple[str, ...]:
        """The terms the transform reads when built with `kwargs` (the factory's defaults
        for the arguments they omit)."""
        kwargs = kwargs or {}
        out = []
        for r in self.requires:
            if isinstance(r, ByArg):
                out += [t for t in r.get(kwargs.get(r.arg, r.default)) if t not in out]
            elif r not in out:
                out.append(r)
        return tuple(out)

    def unlisted(self, kwargs: dict[str, Any]) -> list[str]:
        """Arguments in `kwargs` whose value a `ByArg` requirement does not list."""
        return [
            f"{r.arg}={kwargs[r.arg]!r}"
            for r in self.requires
            if isinstance(r, ByArg) and r.arg in kwargs and not r.lists(kwargs[r.arg])
        ]


def _as_terms(t: str | tuple[str, ...]) -> tuple[str, ...]:
    return (t,) if isinstance(t, str) else tuple(t)


class Objective(NamedTuple):
    batch: Transform  # The batch-stage transforms, chained (possibly none).
    loss: Transform  # The loss-stage transforms, chained; ends in an aggregation.
    model_terms: frozenset[str]  # The subset of MODEL_TERMS the chain requires.
    reads: frozenset[str]  # Every term the chain's transforms require.


_REGISTRY: dict[str, Entry] = {}


def register(
    name: str, *, stage: str, requires: tuple[str | ByArg, ...], provides: tuple[str, ...]
):
    """Registers a transform factory under `name` (a decorator; returns the factory).

    `requires` names terms, or `ByArg`s choosing terms by one of the factory's arguments.
    """
    if stage not in STAGES:
        raise ValueError(f"register({name!r}): stage={stage!r} is not one of {STAGES}")

    def decorate(factory):
        old = _REGISTRY.get(name)
        if old is not None and old.factory.__qualname__ != factory.__qualname__:
            raise ValueError(f"transform {name!r} is already registered ({old.factory})")
        params = inspect.signature(factory).parameters
        declared = []
        for r in requires:
            if isinstance(r, ByArg):
                default = getattr(params.get(r.arg), "default", inspect.Parameter.empty)
                if default is inspect.Parameter.empty or default not in r.terms:
                    raise ValueError(
                        f"register({name!r}): ByArg({r.arg!r}) needs an argument {r.arg!r} "
                        f"whose default is one of {tuple(r.terms)}"
                    )
                r = r._replace(default=default)
            declared.append(r)
        _REGISTRY[name] = Entry(name, factory, stage, tuple(declared), tuple(provides))
        return factory

    return decorate


def names() -> tuple[str, ...]:
    """Registered transform names, in registration order."""
    return tuple(_REGISTRY)


def entries() -> tuple[Entry, ...]:
    """Every registered transform with its stage and terms."""
    return tuple(_REGISTRY.values())


def table() -> str:
    """The registry as a Markdown table (the README's): batch stage first, aggregations last."""
    rows = ["| transform | stage | requires | provides |", "| --- | --- | --- | --- |"]
    order = sorted(entries(), key=lambda e: (STAGES.index(e.stage), "loss_sum" in e.provides))
    for e in order:
        requires = ", ".join(r.text() if isinstance(r, ByArg) else r for r in e.requires)
        rows.append(f"| `{e.name}` | {e.stage} | {requires} | {', '.join(e.provides)} |")
    return "\n".join(rows)


def parse(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """`"a | b(k=v, ...)"` -> [("a", {}), ("b", {"k": v})].

    Values are Python literals (`ast.literal_eval`); a bare word that is not one is a string,
    so `mode=prompt_mean` and `mode='prompt_mean'` are the same. Whitespace is free.

    Raises:
      ValueError: naming the part that does not parse.
    """
    if not isinstance(spec, str):
        raise ValueError(f"expected a string of transforms separated by '|', got {spec!r}")
    if not spec.strip():
        return []
    items = []
    for text in (part.strip() for part in spec.split("|")):
        if not text:
            raise ValueError(f"an empty transform between '|'s in {spec!r}")
        expected = f"cannot parse {text!r}: expected name or name(key=value, ...)"
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise ValueError(expected) from None
        if isinstance(node, ast.Name):
            items.append((node.id, {}))
            continue
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError(expected)
        if node.args or any(kw.arg is None for kw in node.keywords):
            raise ValueError(f"{text!r}: arguments are key=value")
        items.append((node.func.id, {kw.arg: _literal(kw.value, text) for kw in node.keywords}))
    return items


def _literal(node, text):
    if isinstance(node, ast.Name):  # A bare word (True, False and None are constants).
        return node.id
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(
            f"{text!r}: {ast.unparse(node)} is not a literal (quote a string with spaces "
            "or symbols)"
        ) from None


def check(
    spec: str, *, group_size: int, max_len: int, key: str = "objective.chain", absent=None
) -> list[str]:
    """Every problem with a chain, as messages naming `key`; never raises.

    Problems: a spec that does not parse; an unknown transform; an unknown argument, one of
    the wrong type, or one its factory rejects; a batch-stage transform after a loss-stage
    one; a required term (as the transform's arguments choose it) that neither the run
    supplies to that stage nor an earlier transform provides, or that this run cannot supply
    (`absent`, a dict term -> why: e.g. the generator's `sampler_logp` of greedy samples); a term
    changed after every transform that reads it (KL in the reward after the advantages); a
    loss stage that does not end in an aggregation; a value head read (GAE's `old_value`)
    that nothing trains.
    """
    try:
        items = parse(spec)
    except ValueError as e:
        return [f"{key}: {e}"]
    # known[i]: the i-th transform's entry (None if unknown); reads[i]: the terms it reads.
    problems, provided, known, reads = [], set(), [], []
    first_loss = None
    for name, kwargs in items:
        entry = _REGISTRY.get(name)
        if entry is None:
            problems.append(f"{key}: unknown transform {name!r}{_suggest(name, names())}")
            known.append(None)
            reads.append(())
            continue
        known.append(entry)
        reads.append(entry.required(_with_run_args(entry, kwargs, group_size, max_len)))
        problems += [f"{key}: {p}" for p in _argument_problems(entry, kwargs, group_size, max_len)]
        if entry.stage == "batch" and first_loss is not None:
            problems.append(
                f"{key}: {name} runs once on the whole batch (stage 'batch') but comes after "
                f"the loss-stage {first_loss}; move it before {first_loss}"
            )
        if entry.stage == "loss" and first_loss is None:
            first_loss = name
        supplied = BATCH_TERMS if entry.stage == "batch" else LOSS_TERMS
        for term in reads[-1]:
            # After an unknown transform, which might have provided anything, say nothing.
            if term not in supplied and term not in provided and None not in known:
                problems.append(f"{key}: {_missing_term(entry, term)}")
            elif term in (absent or {}) and term not in provided:
                problems.append(
                    f"{key}: {name} needs term {term!r}, which this run does not supply: "
                    f"{absent[term]}"
                )
        provided |= set(entry.provides)
    loss_stage = [e for e in known if e is None or e.stage == "loss"]
    if not loss_stage:
        problems.append(
            f"{key}: no loss-stage transforms; the chain must end in an aggregation "
            f"({_providers('loss_sum')})"
        )
    elif loss_stage[-1] is not None and not set(AGGREGATION_TERMS) <= set(loss_stage[-1].provides):
        problems.append(
            f"{key}: the loss stage ends in {loss_stage[-1].name}, not an aggregation that "
            f"provides loss_sum and denominator (end with one of: {_providers('loss_sum')})"
        )
    for i, entry in enumerate(known):
        for term in entry.provides if entry is not None else ():
            readers = [e.name for e, r in zip(known[:i], reads) if e is not None and term in r]
            later = zip(known[i + 1 :], reads[i + 1 :])
            if readers and not any(e is None or term in r for e, r in later):
                problems.append(
                    f"{key}: {entry.name} changes term {term!r} after {readers[0]} read it, "
                    f"and nothing after it reads it; move it before {readers[0]}"
                )
    required = {t for r in reads for t in r}
    if "old_value" in required and "value" not in required:
        reader = next(e.name for e, r in zip(known, reads) if "old_value" in r)
        problems.append(
            f"{key}: {reader} reads the value head (old_value), which nothing in the chain "
            f"trains (add one of: {_providers_of_requirement('value')})"
        )
    return problems


def resolve(spec: str, *, group_size: int, max_len: int) -> list[tuple[Entry, dict[str, Any]]]:
    """The chain's transforms with every keyword argument they are built with (the spec's
    and the run's). Raises ValueError like `build`."""
    problems = check(spec, group_size=group_size, max_len=max_len)
    if problems:
        raise ValueError("Invalid objective:\n  " + "\n  ".join(problems))
    out = []
    for name, kwargs in parse(spec):
        entry = _REGISTRY[name]
        out.append((entry, _with_run_args(entry, kwargs, group_size, max_len)))
    return out


@functools.cache
def build(spec: str, *, group_size: int, max_len: int) -> Objective:
    """The objective a chain string names: its batch and loss transforms, and the model
    terms it requires, as its transforms' arguments choose them (`value` implies
    `old_value`, which the value loss clips against). Built once per arguments: the learner's
    update is compiled for its objective (a static argument), so runs in one process with
    the same chain share their compiled programs instead of tracing them again.

    Raises:
      ValueError: "Invalid objective:" and every problem `check` finds.
    """
    batch, loss, required = [], [], set()
    for entry, kwargs in resolve(spec, group_size=group_size, max_len=max_len):
        (batch if entry.stage == "batch" else loss).append(entry.factory(**kwargs))
        required |= set(entry.required(kwargs))
    model_terms = required & set(MODEL_TERMS)
    if "value" in model_terms:
        model_terms.add("old_value")
    return Objective(chain(*batch), chain(*loss), frozenset(model_terms), frozenset(required))


def _with_run_args(entry, kwargs, group_size, max_len):
    params = inspect.signature(entry.factory).parameters
    run = {"group_size": group_size, "max_len": max_len}
    return {**{k: v for k, v in run.items() if k in params and k not in kwargs}, **kwargs}


def _argument_problems(entry, kwargs, group_size, max_len) -> list[str]:
    params = inspect.signature(entry.factory).parameters
    problems = []
    for k, v in kwargs.items():
        if k not in params:
            own = [p for p in params if p not in RUN_ARGS]
            problems.append(
                f"{entry.name} has no argument {k!r}{_suggest(k, own)} "
                f"(its arguments: {', '.join(own) or 'none'})"
            )
        elif not _accepts(params[k].annotation, v):
            problems.append(f"{entry.name}({k}={v!r}): expected {_type_name(params[k].annotation)}")
    if problems:
        return problems
    try:
        entry.factory(**_with_run_args(entry, kwargs, group_size, max_len))
    except (ValueError, TypeError) as e:
        text = str(e)  # A factory's own message may already name it.
        return [text if text.startswith(f"{entry.name}: ") else f"{entry.name}: {text}"]
    except Exception as e:  # `check` reports; it never raises.
        return [f"{entry.name}: {type(e).__name__}: {e}"]
    # A value the factory accepts but the registration lists no terms for: a registry bug.
    return [
        f"{entry.name}({arg}): the factory accepts it but its registration lists no terms for it"
        for arg in entry.unlisted(kwargs)
    ]


def _options(annotation):
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _accepts(annotation, value) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    for t in _options(annotation):
        if value is None and t is type(None):
            return True
        if t is bool and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if t is float and isinstance(value, int | float):
            return True
        if t in (int, str) and isinstance(value, t):
            return True
    return False


def _type_name(annotation) -> str:
    return " or ".join(
        "None" if t is type(None) else getattr(t, "__name__", str(t))
        for t in _options(annotation)
        if t is not Callable  # Schedules are for Python callers; a config gives a number.
    )


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _providers(term: str, before_stage: str | None = None) -> str:
    return ", ".join(
        e.name
        for e in entries()
        if term in e.provides
        and term not in e.required()
        and (before_stage != "batch" or e.stage == "batch")
    )


def _providers_of_requirement(term: str) -> str:
    return ", ".join(e.name for e in entries() if term in e.required())


def _missing_term(entry: Entry, term: str) -> str:
    if entry.stage == "batch" and term in LOSS_TERMS:
        return (
            f"{entry.name} needs term {term!r}, which the run supplies only to the loss stage "
            "(in the differentiated loss, per micro-batch)"
        )
    providers = _providers(term, entry.stage)
    hint = f" (add one of: {providers})" if providers else ""
    return f"{entry.name} needs term {term!r}, which nothing before it provides{hint}"
