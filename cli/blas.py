"""Finds an optimized BLAS to preload into processes that run MLX on Linux (docs/design.md, "The BLAS on Linux").

`python -m cli.blas` prints the library path (empty where there is none), for shell commands:
    LD_PRELOAD=$(python -m cli.blas) python -m pytest
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

CANDIDATES = ("libmkl_rt.so.3", "libmkl_rt.so.2")
SYSTEM_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def find_blas() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return None  # macOS uses Accelerate; nothing to preload
    for lib in (Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"):
        for name in CANDIDATES:
            if (lib / name).exists():
                return str(lib / name)
    return str(SYSTEM_OPENBLAS) if SYSTEM_OPENBLAS.exists() else None


def blas_env(env: Optional[dict] = None) -> dict:
    """A copy of env with the BLAS in LD_PRELOAD (unchanged where none is found or it is there)."""
    env = dict(os.environ if env is None else env)
    lib = find_blas()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    return env


def blas_preloaded() -> bool:
    lib = find_blas()
    return lib is None or lib in os.environ.get("LD_PRELOAD", "")


def reexec_with_blas() -> None:
    """Restarts this process with the BLAS preloaded, if it is not (the variable must be set at start)."""
    if not blas_preloaded():
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], blas_env())


if __name__ == "__main__":
    print(find_blas() or "")
