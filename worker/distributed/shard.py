"""Splits a loaded model over a distributed group with mlx-lm's own sharding: `tensor` (each
rank holds a slice of every layer; an all_sum joins them) or `pipeline` (each rank holds some
layers; the hidden state passes from rank to rank)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "linear_num_key_heads", "linear_num_value_heads")


class ShardError(ValueError):
    """The model cannot be split this way over this many ranks."""


def _config(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    fields = dict(vars(args)) if args is not None else {}
    text = fields.get("text_config")
    return {**fields, **text} if isinstance(text, dict) else fields


def check_tensor_split(model: nn.Module, n: int) -> None:
    """Every split dimension must divide by the ranks (mlx-lm slices heads and MLP rows)."""
    config = _config(model)
    for name in SPLIT_FIELDS:
        value = config.get(name)
        if isinstance(value, int) and value % n:
            raise ShardError(f"cannot split the model {n} ways: its {name} ({value}) is not divisible by {n}")


def shard_model(model: nn.Module, group: mx.distributed.Group, how: str) -> str:
    """Splits `model` in place (before its weights are read); returns the sharding's identity."""
    n = group.size()
    kind = type(model).__module__.rsplit(".", 1)[-1]
    if how == "tensor":
        if not hasattr(model, "shard"):
            raise ShardError(f"mlx-lm has no tensor sharding for {kind} models (try --shard pipeline)")
        check_tensor_split(model, n)
        try:
            model.shard(group)
        except (AssertionError, ValueError) as e:
            raise ShardError(f"cannot split the {kind} model {n} ways: {e}") from None
    elif how == "pipeline":
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ShardError(f"mlx-lm has no pipeline sharding for {kind} models (try --shard tensor)")
        try:
            inner.pipeline(group)
        except ValueError as e:
            raise ShardError(f"cannot split the {kind} model's layers over {n} ranks: {e}") from None
    else:
        raise ShardError(f"unknown sharding {how!r}: tensor or pipeline")
    return f"{how}/{n}"
