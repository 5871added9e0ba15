"""The collectives of a compiled program, read from its HLO text: per kind (all-gather,
reduce-scatter, all-to-all, all-reduce, collective-permute) how many and how many bytes each
device sends, in all and inside the mixture of experts' dispatch (`moe.experts` runs it under
the named scope `expert_dispatch_<name>`, which XLA keeps in each op's `op_name`).

Bytes sent per device follow the usual ring and direct algorithms (NCCL's "bus bandwidth"
accounting), with R the op's result bytes on one device and n its group's devices:
all-gather R (n - 1) / n, reduce-scatter R (n - 1), all-to-all R (n - 1) / n, all-reduce
2 R (n - 1) / n, collective-permute R. Like XLA's cost analysis, an op in a loop body counts
once per program.
"""

import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute")
DISPATCH_SCOPE = "expert_dispatch_"  # `moe.experts`' named scope.

# `%name = <result shape> <kind>(` (or `<kind>-start(`, the asynchronous form).
_OP = re.compile(r"=\s+(?P<shape>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4}


def _bytes(shape: str, last: bool) -> int:
    """Bytes of an HLO shape (a tuple's elements summed; with `last`, its last element)."""
    arrays = [m for m in _ARRAY.finditer(shape) if m["dtype"] != "token"]
    if last and len(arrays) > 1:
        arrays = arrays[-1:]
    total = 0
    for m in arrays:
        dtype = m["dtype"]
        bits = _BITS.get(dtype) or int(re.sub(r"^[a-z]+", "", dtype) or 8)
        total += math.prod(int(d) for d in m["dims"].split(",") if d) * bits // 8
    return total


def group_size(line: str) -> int | None:
    """The devices of the op's replica groups: `mesh['a'=8,'b'=1] {'a'}` (the listed axes'
    sizes multiplied), `{{0,1,2,3},...}` (the first group's) or `[2,4]<=[8]` (the last
    dimension); None where the line has none of these."""
    m = re.search(r"replica_groups=mesh\[(?P<sizes>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m["sizes"]))
        axes = re.findall(r"'([^']+)'", m["axes"])
        return math.prod(int(sizes[a]) for a in axes if a in sizes)
    m = re.search(r"replica_groups=\{\{(?P<first>[0-9,]*)\}", line)
    if m:
        return len(m["first"].split(","))
    m = re.search(r"replica_groups=\[(?P<dims>[0-9,]+)\]<=", line)
    if m:
        return int(m["dims"].split(",")[-1])
    return None


def _sent(kind: str, result: int, n: int | None) -> float:
    if n is None or n <= 1:
        return 0.0 if n == 1 else float(result)
    return {
        "all-gather": result * (n - 1) / n,
        "reduce-scatter": result * (n - 1),
        "all-to-all": result * (n - 1) / n,
        "all-reduce": 2 * result * (n - 1) / n,
        "collective-permute": result,
    }[kind]


def collectives(text: str) -> dict:
    """Per kind of collective in the HLO `text` (`compiled.as_text()`) that occurs, in all
    and in the experts' dispatch: {"all": {kind: {"count", "bytes"}}, "expert_dispatch":
    {...}}, bytes sent per device (module docstring)."""
    out: dict = {"all": {}, "expert_dispatch": {}}
    for line in text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        kind = m["kind"]
        async_start = line[m.end() - len("-start(") : m.end()] == "-start("
        sent = _sent(kind, _bytes(m["shape"], async_start), group_size(line))
        where = ["all"] + (["expert_dispatch"] if DISPATCH_SCOPE in line else [])
        for w in where:
            entry = out[w].setdefault(kind, {"count": 0, "bytes": 0.0})
            entry["count"] += 1
            entry["bytes"] += sent
    return out
