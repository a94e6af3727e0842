"""launch-stack's memory flags (docs/memory.md): idle unload, a LoRA adapter, the context policy,
quantized KV. They are the worker's: launch-stack checks what it can and passes them on (the
model's head_dim against --kv-group-size is the worker's to check)."""

from __future__ import annotations

import argparse
import os
from typing import Optional, get_args

from protocol import messages as m


def add_memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--idle-unload-s", type=float, default=None,
                   help="free the model's weights and caches after this many seconds with no request; "
                        "the next request loads it again (default: never)")
    p.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="a LoRA adapter in mlx-lm's format (adapter_config.json, adapters.safetensors) on the model")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens a request's prompt and answer may fill, at most the model's own limit (default: the model's)")
    p.add_argument("--context-overflow", choices=get_args(m.ContextOverflow), default="refuse",
                   help="what a request past the context gets unless it asks otherwise (docs/memory.md)")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="keep the attention layers' keys and values quantized to 4 or 8 bits (default: the model's dtype)")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="with --kv-bits: values of the head dim sharing one scale and bias (default 64)")


def memory_flag_problem(a: argparse.Namespace) -> Optional[str]:
    """What is wrong with the memory flags given (the model's own limit is the worker's to check)."""
    if a.idle_unload_s is not None and a.idle_unload_s <= 0:
        return f"--idle-unload-s {a.idle_unload_s:g} must be above 0"
    if a.max_context is not None and a.max_context < 2:
        return f"--max-context {a.max_context} must be at least 2"
    if a.kv_group_size is not None and a.kv_bits is None:
        return "--kv-group-size needs --kv-bits"
    group = (getattr(a, "ranks", 1) or 1) > 1 or getattr(a, "hostfile", None)
    if group and (a.idle_unload_s or a.adapter_path):
        return "--idle-unload-s and --adapter-path serve one worker process, not a distributed group"
    return None


def worker_memory_args(a: argparse.Namespace) -> list[str]:
    """The worker's share of them: only those given."""
    out = ["--context-overflow", a.context_overflow] if a.context_overflow != "refuse" else []
    for flag, value in (("--idle-unload-s", a.idle_unload_s),
                        ("--adapter-path", a.adapter_path and os.path.abspath(a.adapter_path)),
                        ("--max-context", a.max_context), ("--kv-bits", a.kv_bits),
                        ("--kv-group-size", a.kv_group_size)):
        if value is not None:
            out += [flag, str(value)]
    return out
