"""Every environment variable Tilecraft reads, in one place (mirrored in README.md).

Read values through `get(name)`; never call os.environ for a TILECRAFT_* variable elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str


VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("TILECRAFT_TARGET", "", "force a target (cuda:sm_90a, cuda:sm_100a, ascend:950, cpu); default: from the tensors' device"),
        EnvVar("TILECRAFT_CACHE_DIR", "~/.cache/tilecraft",
               "where compiled kernels (and generated sources, `codegen.show`) are kept between processes"),
        EnvVar("TILECRAFT_DISABLE_DISK_CACHE", "0", "1: compile in every process, keep kernels in memory only"),
        EnvVar("TILECRAFT_NVCC", "", "path of the nvcc to use; default: CUDA_HOME, then CUDA_PATH, then PATH, then the nvidia-cuda-nvcc wheel"),
        EnvVar("TILECRAFT_BISHENG", "", "path of CANN's bisheng compiler; default: BISHENG_HOME/bin, ASCEND_HOME_PATH, then PATH"),
        EnvVar("TILECRAFT_BATCH_INVARIANT", "0", "1: MLA decode splits each sequence the same way whatever the batch (bitwise batch-invariant)"),
        EnvVar("TILECRAFT_CHECK_VALUES", "1", "0: skip checks that read tensor values (index ranges, finite router logits): one device sync per call, never during CUDA graph capture"),
        EnvVar("TILECRAFT_EP_TRANSPORT", "auto", "expert-parallel moe_dispatch/moe_combine: peer (peer memory on one host, torch symmetric memory), a2a (all_to_all_single chunks), auto: peer on an NCCL group whose ranks share a host and reach each other's GPUs (P2P), else a2a"),
        EnvVar("TILECRAFT_VERBOSE", "0", "1: log every compile and cache decision to stderr"),
    )
}


def get(name: str) -> str:
    """The variable's value, or its default when unset or empty."""
    var = VARS[name]
    value = os.environ.get(name, "")
    return value if value != "" else var.default


def set(name: str, value: str) -> None:
    """Set a Tilecraft variable for this process (tools that need, e.g., value checks off)."""
    VARS[name]        # a KeyError names an unknown variable
    os.environ[name] = value


@contextlib.contextmanager
def overridden(name: str, value: str):
    """`name` set to `value` inside the block, put back as it was (unset included) after it."""
    VARS[name]
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def flag(name: str) -> bool:
    return get(name).strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    return Path(os.path.expanduser(get("TILECRAFT_CACHE_DIR")))


def markdown_table() -> str:
    """The README's env-var table, generated so that the two cannot drift apart."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for v in VARS.values():
        rows.append(f"| `{v.name}` | `{v.default or '(unset)'}` | {v.doc} |")
    return "\n".join(rows)
