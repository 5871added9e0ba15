"""The machine a benchmark ran on: the device and the software versions (JAX, jaxlib, the
CUDA plugin and libraries, the driver where `nvidia-smi` answers), and the key of the
device's row in the planner's accelerator table (`rlscale.planning.report.ACCELERATORS`:
datasheet peaks)."""

import importlib.metadata
import os
import platform
import shutil
import subprocess

import jax

PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
)
# (a part of `device_kind`, parts it must not have, the `ACCELERATORS` key). The table's
# NVIDIA rows are the SXM parts: an H100 PCIe or NVL has other peaks, and no row.
KINDS = (
    ("H200", (), "h200"),
    ("H100", ("PCIe", "NVL"), "h100"),
    ("TPU v5 lite", (), "tpu_v5e"),
    ("TPU v5p", (), "tpu_v5p"),
    ("TPU v6 lite", (), "tpu_v6e"),
)
# The rows `--accelerator` may name (the table's keys: tests/test_gpu_check.py checks).
TABLE_KEYS = tuple(key for _, _, key in KINDS)


def accelerator_key(device_kind: str) -> str | None:
    """The `ACCELERATORS` key of a device kind, or None (a CPU, an accelerator without a
    row)."""
    for part, excluded, key in KINDS:
        if part in device_kind and not any(x in device_kind for x in excluded):
            return key
    return None


def _versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _cuda_versions() -> dict:
    """The CUDA libraries' versions as jaxlib's CUDA plugin reports them (JAX's own module,
    not public: whatever answers)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    if cuda_versions is None:  # A jaxlib without its CUDA plugin.
        return {}
    out = {}
    for name in dir(cuda_versions):
        if name.endswith("_version") and callable(getattr(cuda_versions, name)):
            try:
                out[name.removesuffix("_version")] = getattr(cuda_versions, name)()
            except Exception as e:  # noqa: BLE001 (a library it cannot load: say so)
                out[name.removesuffix("_version")] = f"{type(e).__name__}: {e}"
    return out


def _nvidia_smi() -> dict:
    if not shutil.which("nvidia-smi"):
        return {}
    fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return dict(zip(fields.split(","), (v.strip() for v in line.split(","))))


def describe() -> dict:
    """The device, its `ACCELERATORS` key (None without a row), the versions."""
    device = jax.devices()[0]
    key = accelerator_key(device.device_kind)
    stats = device.memory_stats() or {}  # None on a CPU.
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "device_memory_bytes": stats.get("bytes_limit"),
        "accelerator": key,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "cuda": _cuda_versions(),
        "nvidia_smi": _nvidia_smi(),
    }
