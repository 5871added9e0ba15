"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): the `config.lora`
section, adapter init, `merge` (W + alpha / r * A @ B in the weight's layout, a pure function),
the cross-section problems, the adapters' PEFT files. See docs/learner.md, "LoRA".

A targeted weight W of the decoder, read as a matrix [inputs, outputs] (its first `n_in` dims
the inputs, as `decoder.project` contracts them), gets A [inputs, r] and B [r, outputs]; the
policy is the base with W + (alpha / r) A @ B in place of each W (r the rank). A starts
uniform in +-1/sqrt(inputs) (PEFT's default) and B at zero, so before the first update the
policy is the base, bit for bit.

Adapters are a nested dict that mirrors the params' paths, string keys:
`{"layers": {"0": {"attn": {"q": {"a": A, "b": B}}}}}`, float32 whatever the base's dtype
(A [inputs, rank], B [rank, outputs]).
"""

import dataclasses
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from rlscale import sections


class Target(NamedTuple):
    path: tuple[str, ...]  # The weight's path under `layers/<i>`.
    n_in: int  # Its leading dims that are inputs (`decoder.project`'s `n_in`).
    module: str  # The Hugging Face module under `model.layers.<i>` (PEFT's key names).


# The projections LoRA can adapt, by their Hugging Face (PEFT `target_modules`) names.
TARGETS = {
    "q_proj": Target(("attn", "q"), 1, "self_attn.q_proj"),
    "k_proj": Target(("attn", "k"), 1, "self_attn.k_proj"),
    "v_proj": Target(("attn", "v"), 1, "self_attn.v_proj"),
    "o_proj": Target(("attn", "o"), 2, "self_attn.o_proj"),
    "gate_proj": Target(("mlp", "gate"), 1, "mlp.gate_proj"),
    "up_proj": Target(("mlp", "up"), 1, "mlp.up_proj"),
    "down_proj": Target(("mlp", "down"), 1, "mlp.down_proj"),
}

# The PEFT version the adapter files are written for and tested against (setup.py's [hf]).
PEFT_VERSION = "0.21.2"


@dataclasses.dataclass(frozen=True)
class LoraConfig(sections.Section):
    """`config.lora`: rank `rank` adapters (0: off, full fine-tuning) on the `targets`
    projections (`TARGETS`), scaled by `alpha / rank`."""

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = tuple(TARGETS)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def problems(self) -> list[str]:
        problems = sections.at_least("lora.rank", self.rank, 0)
        if problems or not self.rank:
            return problems
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            problems.append(f"lora.alpha={self.alpha!r} must be a number > 0")
        targets = self.targets if isinstance(self.targets, tuple) else (self.targets,)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            problems.append(
                f"lora.targets={targets!r}: "
                + (f"{unknown} name no module" if unknown else "empty")
                + f"; valid names: {', '.join(TARGETS)}"
            )
        elif len(set(targets)) != len(targets):
            problems.append(f"lora.targets={targets!r} names a module twice")
        return problems


def run_problems(lora: LoraConfig, learner, preference) -> list[str]:
    """What LoRA cannot combine with, naming the keys: the base is the policy's forward
    weights (on device at every update) and the only reference (one frozen copy)."""
    if not lora.enabled:
        return []
    problems = []
    if learner.offload_ref:
        problems.append(
            "learner.offload_ref=True with lora.rank > 0: the frozen base, which is the "
            "reference, is also the policy's weights and stays in device memory"
        )
    if preference.iterations_every:
        problems.append(
            f"preference.iterations_every={preference.iterations_every} with lora.rank > 0: "
            "an iterative round's reference is the policy at its start, a second copy; LoRA "
            "keeps one frozen base as the reference"
        )
    return problems


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _target_of(names: tuple[str, ...], targets) -> str | None:
    """The target (of `targets`) that the param at `names` is, or None."""
    if len(names) < 3 or names[0] != "layers":
        return None
    return next((t for t in targets if TARGETS[t].path == names[2:]), None)


def _lookup(adapters: dict, names: tuple[str, ...]):
    node = adapters
    for name in names:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node


def _matrix_dims(shape, n_in: int) -> tuple[int, int]:
    return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def init(base_params, cfg: LoraConfig, rng) -> dict:
    """Fresh adapters for `base_params` (on the default device): A uniform in +-1/sqrt(inputs), B
    zero, so the adapted policy starts as the base.

    Raises:
      ValueError: naming `lora.targets` entries that match no weight of this model.
    """
    adapters, found = {}, set()
    leaves = jax.tree_util.tree_flatten_with_path(base_params, is_leaf=_is_variable)[0]
    for i, (path, var) in enumerate(leaves):
        names = _names(path)
        target = _target_of(names, cfg.targets)
        if target is None:
            continue
        found.add(target)
        inputs, outputs = _matrix_dims(var.shape, TARGETS[target].n_in)
        bound = 1.0 / math.sqrt(inputs)
        a = jax.random.uniform(
            jax.random.fold_in(rng, i), (inputs, cfg.rank), jnp.float32, -bound, bound
        )
        node = adapters
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = {"a": a, "b": jnp.zeros((cfg.rank, outputs), jnp.float32)}
    missing = [t for t in cfg.targets if t not in found]
    if missing:
        raise ValueError(
            f"lora.targets: {missing} match no weight of this model (targets it has: "
            f"{sorted(found) or 'none'})"
        )
    return adapters


def delta(a, b, shape, scale: float):
    """scale * A @ B in float32, in a weight's layout `shape`."""
    d = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    return (d * jnp.float32(scale)).reshape(shape)


def merge(base_params, adapters: dict, scale: float):
    """The adapted params: each adapted W replaced by W + scale * A @ B, added in float32 and
    rounded once to W's dtype; every other param is the base's (the same array)."""

    def leaf(path, var):
        node = _lookup(adapters, _names(path))
        if node is None:
            return var
        w = var[...]
        merged = w.astype(jnp.float32) + delta(node["a"], node["b"], w.shape, scale)
        return var.replace(merged.astype(w.dtype))

    return jax.tree_util.tree_map_with_path(leaf, base_params, is_leaf=_is_variable)


# The merge as one program (what `rl.setup.Setup` runs at each weight swap).
merged = jax.jit(merge, static_argnames=("scale",))


def num_params(adapters: dict) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))


def peft_tensors(adapters: dict, cfg: LoraConfig) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layouts: `lora_A.weight` [rank, inputs] and
    `lora_B.weight` [outputs, rank] of `base_model.model.model.layers.<i>.<module>` (a torch
    Linear's weight is [out, in]: the Hugging Face weight is W^T, its delta B^T A^T)."""
    out = {}
    for i, layer in sorted(adapters.get("layers", {}).items(), key=lambda kv: int(kv[0])):
        for target in cfg.targets:
            node = _lookup(layer, TARGETS[target].path)
            if node is None:
                continue
            prefix = f"base_model.model.model.layers.{i}.{TARGETS[target].module}"
            a, b = (np.asarray(jax.device_get(node[k]), np.float32) for k in ("a", "b"))
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return out


def save_peft(path: str, adapters: dict, cfg: LoraConfig, base: str) -> None:
    """A PEFT adapter directory: `adapter_config.json` and `adapter_model.safetensors`, which
    `peft.PeftModel.from_pretrained(base_model, path)` loads onto the Hugging Face export of
    the base (`base`: its name or path, recorded as `base_model_name_or_path`)."""
    os.makedirs(path, exist_ok=True)
    save_file(
        peft_tensors(adapters, cfg),
        os.path.join(path, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "target_modules": sorted(cfg.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "revision": None,
        "peft_version": PEFT_VERSION,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
