"""Joining a multi-process job from its launch environment (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; a TPU pod's own), and JAX's persistent compilation
cache: what a command does before it builds anything."""

import os
import socket
import sys
import threading
import time

import jax

# Environment variables of a multi-process launch (one process per host or per GPU).
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_settings(env=os.environ) -> dict | None:
    """`jax.distributed.initialize` arguments from the launch environment, or None for a
    single process. On a TPU pod (TPU_WORKER_HOSTNAMES set, no coordinator given) JAX finds
    the coordinator itself. Raises ValueError naming the bad variable."""
    address = env.get("JAX_COORDINATOR_ADDRESS", "")
    if not address:
        return {} if env.get("TPU_WORKER_HOSTNAMES") else None
    problems, values = [], {}
    for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        text = env.get(name, "")
        if not text.strip().isdigit():
            problems.append(f"{name}={text!r} must be a non-negative integer")
        else:
            values[name] = int(text)
    n, pid = values.get("JAX_NUM_PROCESSES"), values.get("JAX_PROCESS_ID")
    if n is not None and n < 1:
        problems.append(f"JAX_NUM_PROCESSES={n} must be >= 1")
    if n is not None and pid is not None and pid >= n:
        problems.append(f"JAX_PROCESS_ID={pid} is not below JAX_NUM_PROCESSES={n}")
    if ":" not in address:
        problems.append(f"JAX_COORDINATOR_ADDRESS={address!r} must be host:port")
    if problems:
        raise ValueError("bad multi-process launch:\n  " + "\n  ".join(problems))
    timeout = int(env.get("JAX_INITIALIZATION_TIMEOUT", "300"))
    return dict(
        coordinator_address=address,
        num_processes=n,
        process_id=pid,
        initialization_timeout=timeout,
    )


def _wait_for_coordinator(address: str, timeout: float, why: str) -> None:
    """Returns once the coordinator accepts connections; ValueError after `timeout` s."""
    host, _, port = address.rpartition(":")
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise ValueError(
                    f"no coordinator at {address} within {timeout:g} s: {why}"
                ) from None
            time.sleep(0.2)


def maybe_initialize_distributed(env=os.environ):
    """Joins the multi-process job described by the environment (`distributed_settings`).

    CPU processes exchange collectives over gloo. A process that finds no coordinator fails
    naming the variables; when the job does not assemble in time (JAX_NUM_PROCESSES larger
    than the processes launched), JAX aborts the process, so the reason is printed first.
    """
    settings = distributed_settings(env)
    if settings is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backend only.
    if not settings:  # A TPU pod: JAX finds the coordinator.
        jax.distributed.initialize()
        return
    n, address = settings["num_processes"], settings["coordinator_address"]
    timeout = settings["initialization_timeout"]
    why = (
        f"the {n}-process job (JAX_NUM_PROCESSES={n}) needs process 0 running at "
        "JAX_COORDINATOR_ADDRESS, and JAX_NUM_PROCESSES must match the number of processes "
        "launched, each with a distinct JAX_PROCESS_ID"
    )
    if settings["process_id"] != 0:
        _wait_for_coordinator(address, timeout, why)
    warning = threading.Timer(
        max(timeout - 1.0, 0.5),
        lambda: print(
            f"error: the job did not assemble within {timeout} s: {why}",
            file=sys.stderr,
            flush=True,
        ),
    )
    warning.daemon = True
    warning.start()
    try:
        jax.distributed.initialize(**settings)
    finally:
        warning.cancel()
    if jax.process_count() != n:
        raise ValueError(
            f"JAX_NUM_PROCESSES={n}, but the coordinator counts {jax.process_count()} processes"
        )


def use_compilation_cache(directory: str, env=os.environ) -> None:
    """Points JAX's persistent compilation cache at `directory` (every program, however
    quick to compile), unless it is '' or JAX_COMPILATION_CACHE_DIR already chose one."""
    if directory and not env.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
