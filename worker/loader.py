"""Loads the served model: the embedded GGUF, a local MLX folder, or a Hugging Face id."""

from __future__ import annotations

import hashlib
import logging
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

log = logging.getLogger("verity.worker")

EMBEDDED = "embedded"
DEFAULT_CONTEXT_LIMIT = 4096
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # what mlx-lm's LoRA and DoRA layers add


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    model_id: str  # the name /v1/models serves
    revision: str  # cheap identity: never a hash of all the weights
    quantization: str
    context_limit: int
    chat_template: Optional[str]
    sharding: str = ""  # a distributed group's split, e.g. "tensor/2" ("": the whole model)
    adapter: str = ""  # a LoRA adapter on the weights: "name@hash of its files" ("": none)


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


# the releases verity is tested with; others load with a warning (it reads only mlx-lm's public names)
TESTED = {"mlx": ((0, 32), (0, 33)), "mlx-lm": ((0, 32), (0, 33))}


def untested_versions() -> list[str]:
    """The installed MLX packages outside the tested range, as 'name version'."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name, (low, high) in TESTED.items():
        try:
            v = version(name)
        except PackageNotFoundError:  # MLX's CUDA or Metal build installed under another name
            continue
        parts = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
        if not low <= parts < high:
            out.append(f"{name} {v}")
    return out


def load_model(spec: str = EMBEDDED, float_weights: bool = False,
               shard: Optional[Callable[[nn.Module], str]] = None, adapter_path: Optional[str] = None) -> LoadedModel:
    """`float_weights`: the embedded model dequantized even on a GPU (the distillation copies its layers).
    `shard(model) -> sharding`: splits the model for a distributed group before its weights load.
    `adapter_path`: a LoRA adapter in mlx-lm's format, applied to the model (its id names it)."""
    lm = _load_base(spec, float_weights, shard)
    if adapter_path:
        apply_adapter(lm, Path(adapter_path).expanduser())
    return lm


def _load_base(spec: str, float_weights: bool, shard: Optional[Callable[[nn.Module], str]]) -> LoadedModel:
    for found in untested_versions():
        log.warning("%s is outside the releases verity is tested with (%s)", found,
                    ", ".join(f"{n} {a[0]}.{a[1]}.x" for n, (a, _) in TESTED.items()))
    if spec == EMBEDDED:
        lm = _load_embedded(quantized=on_gpu() and not float_weights)
        if shard:
            lm.sharding = shard(lm.model)
            mx.eval(lm.model.parameters())
        return lm
    path = Path(spec).expanduser()
    if path.exists():
        return _load_folder(path, path.resolve().name, shard)
    from mlx_lm.utils import hf_repo_to_path  # a user's own machine may fetch it

    return _load_folder(Path(hf_repo_to_path(spec)), spec, shard)


def _load_embedded(quantized: bool) -> LoadedModel:
    from worker.gguf import embedded_gguf_path, load_gguf

    path = embedded_gguf_path()
    model, tokenizer, info = load_gguf(path, quantized=quantized)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=info["model_id"],
        revision=file_identity(path),
        quantization=info["quantization"],
        context_limit=int(info["context_limit"]),
        chat_template=info.get("chat_template"),
    )


def _load_folder(path: Path, model_id: str, shard: Optional[Callable[[nn.Module], str]] = None) -> LoadedModel:
    from mlx_lm.utils import load

    model, tokenizer, config = load(str(path), return_config=True, lazy=shard is not None)
    sharding = shard(model) if shard else ""  # lazy: only this rank's part of the weights is read
    quant = config.get("quantization")
    if not on_gpu() and not quant:
        model.set_dtype(mx.float32)  # float32 is the fast dtype on CPU
    mx.eval(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        revision=folder_identity(path),
        quantization=f"q{quant['bits']}g{quant['group_size']}" if quant else str(_dtype_of(model)),
        context_limit=int(_context_limit(config)),
        chat_template=getattr(tokenizer, "chat_template", None),
        sharding=sharding,
    )


class AdapterError(ValueError):
    """The adapter cannot be applied to the model."""


def apply_adapter(lm: LoadedModel, path: Path) -> None:
    """mlx-lm's LoRA layers with the adapter's weights (its public `load_adapters`), in the
    model's own float dtype; the model's id becomes `model+adapter`."""
    from mlx_lm.tuner.utils import load_adapters

    if not (path / "adapter_config.json").is_file() or not (path / "adapters.safetensors").is_file():
        raise AdapterError(f"{path} is not an mlx-lm adapter: it needs adapter_config.json and adapters.safetensors")
    try:
        load_adapters(lm.model, str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AdapterError(f"the adapter at {path} does not fit {lm.model_id}: {e}") from None
    params = tree_flatten(lm.model.parameters())
    lora = {k for k, _ in params if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES}
    dtype = next(v.dtype for k, v in params if mx.issubdtype(v.dtype, mx.floating) and k not in lora)
    lm.model.update(tree_unflatten([(k, v.astype(dtype)) for k, v in params if k in lora]))
    lm.model.eval()
    mx.eval(lm.model.parameters())
    lm.adapter = f"{path.resolve().name}@{adapter_identity(path)}"
    lm.model_id = f"{lm.model_id}+{path.resolve().name}"


def adapter_identity(path: Path) -> str:
    """Hash of the adapter's config and weights, whole (an adapter is small; two of the same
    shapes differ only in their values)."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapters.safetensors"):
        with open(path / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


class PairingError(ValueError):
    """The draft cannot be paired with the target."""


def load_draft(spec: str, target: LoadedModel) -> LoadedModel:
    """Loads a draft and checks that its tokenizer agrees with the target's. "embedded": the
    draft distilled from the embedded model (worker/draft/), on the target's embedding."""
    if spec == EMBEDDED:
        return _load_embedded_draft(target)
    draft = load_model(spec)
    check_tokenizers_agree(target.tokenizer, draft.tokenizer)
    return draft


def _load_embedded_draft(target: LoadedModel) -> LoadedModel:
    from dataclasses import asdict

    from worker.draft.model import ASSET_DIR, DRAFT_ID, load_embedded_draft

    if not (ASSET_DIR / "model.safetensors").exists():
        raise PairingError(f"the embedded draft is not built: {ASSET_DIR} has no model.safetensors (run `verity distill`)")
    meta = json.loads((ASSET_DIR / "config.json").read_text())
    if meta.get("teacher_revision") != target.revision:
        raise PairingError(f"the embedded draft was distilled from {meta.get('teacher')}@{meta.get('teacher_revision')}, "
                           f"not from the served model {target.model_id}@{target.revision}")
    model = load_embedded_draft(target.model, asdict(target.model.args))
    return LoadedModel(model=model, tokenizer=target.tokenizer, model_id=DRAFT_ID,
                       revision=folder_identity(ASSET_DIR), quantization=str(_dtype_of(model)),
                       context_limit=target.context_limit, chat_template=target.chat_template)


def check_tokenizers_agree(target, draft) -> None:
    """What exactness needs: the same id for every token and the same end-of-sequence set. Which
    ids a tokenizer class marks special is not compared (transformers picks the class by model
    type: byte-identical files can mark token 0 special in one only). Raises PairingError naming
    what differs."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:3]
        moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])[:3]
        raise PairingError(
            f"the draft's tokenizer differs from the target's: vocabulary sizes {len(tv)} and {len(dv)}"
            + (f"; tokens only in the target: {only_t}" if only_t else "")
            + (f"; tokens with other ids: {moved}" if moved else "")
        )
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        raise PairingError(f"the draft's end-of-sequence tokens differ from the target's: "
                           f"{sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)}")


def _context_limit(config: dict) -> int:
    text = config.get("text_config", config)
    return text.get("max_position_embeddings") or config.get("max_position_embeddings") or DEFAULT_CONTEXT_LIMIT


def _dtype_of(model: nn.Module) -> str:
    return str(tree_flatten(model.parameters())[0][1].dtype).replace("mlx.core.", "")


def folder_identity(path: Path) -> str:
    """Hash of config, tokenizer config, safetensors headers and file sizes."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}\n".encode())
        if f.suffix == ".json" and f.stat().st_size < 50_000_000:
            h.update(f.read_bytes())
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                h.update(fh.read(min(n, 100_000_000)))
    return h.hexdigest()[:16]


def file_identity(path: Path) -> str:
    """Hash of a single weights file's name, size and first MiB."""
    h = hashlib.sha256(f"{path.name}:{path.stat().st_size}\n".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
