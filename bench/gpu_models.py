"""The shapes `verity bench gpu` and `gpu-batch` build (Qwen3.5-9B target, 0.8B draft, random
weights), and the device figures both read: copy bandwidth, weight bytes a step reads."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5

from worker.state import checkpoint as st

_COMMON = dict(model_type="qwen3_5_text", linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
               vocab_size=248320, max_position_embeddings=32768,
               rope_parameters={"type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25})
TARGET_9B = dict(_COMMON, hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False)
DRAFT_08B = dict(_COMMON, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True)
SMALL = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=32, vocab_size=4096)

DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}


def kernel_available() -> bool:
    from worker.kernels import gdn as gdn_kernel

    return gdn_kernel.available()


def device() -> str:
    d = mx.default_device()
    return f"{d} ({'CUDA' if mx.cuda.is_available() else 'Metal' if mx.metal.is_available() else 'CPU'})" if d == mx.gpu else str(d)


def build(config: dict, dtype=mx.bfloat16, seed: int = 0, bits: Optional[int] = None):
    """A random-weight Qwen3.5 model of the configuration's shape, evaluated on the device."""
    import mlx.nn as nn

    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": config}))
    model.set_dtype(dtype)
    n = n_params(model)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    model.logical_params = n  # packed quantized weights count 32 / bits parameters an element
    st.install_recording(model)
    return model


def n_params(model) -> int:
    return getattr(model, "logical_params", None) or sum(v.size for _, v in tree_flatten(model.parameters()))


def bytes_per_token(model, config: dict) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (one row of it is
    read), unless the table is also the output head."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if not config.get("tie_word_embeddings"):
        total -= sum(v.nbytes for k, v in tree_flatten(model.parameters()) if "embed_tokens" in k)
    return total


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def copy_bandwidth(n_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Device copy bandwidth, bytes read plus bytes written per second."""
    x = mx.random.normal((n_bytes // 2,)).astype(mx.bfloat16)
    mx.eval(x)
    t = median_time(lambda: x * 1.0001, reps)
    return 2 * x.nbytes / t


