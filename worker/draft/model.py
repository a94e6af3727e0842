"""The distilled draft of the embedded model: a few llama layers that share the target's embedding.

What ships (worker/draft/embedded/): `config.json` (the layer shapes, which target layers it
started from, the head's vocabulary) and `model.safetensors` (float16: the layers and the final
norm). The embedding matrix is not shipped: the draft uses the target's own embedding module, and
its output head scores only the `head_vocab` tokens (the ones the teacher actually produced),
a slice of that embedding, so a draft step costs a fraction of the full vocabulary's matmul.
Tokens outside the head's vocabulary get -inf: the draft never proposes them; the target decides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

ASSET_DIR = Path(__file__).parent / "embedded"
DRAFT_ID = "smollm2-135m-distilled-draft"


class DraftModel(llama.Model):
    """A llama model whose output head covers a subset of the vocabulary (None: all of it)."""

    def __init__(self, args: llama.ModelArgs, head_vocab: Optional[list[int]] = None):
        super().__init__(args)
        self.set_head_vocab(head_vocab)

    def set_head_vocab(self, head_vocab: Optional[list[int]]) -> None:
        self._head_ids = None if head_vocab is None else mx.array(head_vocab, dtype=mx.uint32)
        self._head_w = None  # rows of the shared embedding, taken on first use

    def head_weight(self) -> mx.array:
        if self._head_w is None:
            w = self.model.embed_tokens.weight
            if isinstance(self.model.embed_tokens, nn.QuantizedEmbedding):
                e = self.model.embed_tokens
                w = mx.dequantize(w, e.scales, e.biases, e.group_size, e.bits)
            self._head_w = mx.contiguous(w[self._head_ids])
            mx.eval(self._head_w)
        return self._head_w

    def subset_logits(self, inputs: mx.array, cache=None) -> mx.array:
        """Logits over head_vocab only (training computes its loss on these)."""
        h = self.model(inputs, cache)
        return h @ self.head_weight().T

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        if self._head_ids is None:
            return super().__call__(inputs, cache, input_embeddings)
        sub = self.subset_logits(inputs, cache)
        full = mx.full((*sub.shape[:-1], self.args.vocab_size), -mx.inf, dtype=sub.dtype)
        full[..., self._head_ids] = sub
        return full


def draft_args(target_args: dict, layers: int) -> llama.ModelArgs:
    """The target's llama shapes with fewer layers (the embedding stays shared, so tied)."""
    a = dict(target_args, num_hidden_layers=layers, tie_word_embeddings=True)
    a.pop("layer_types", None)  # derived from the layer count (a copied list would build the target's 30)
    return llama.ModelArgs(**a)


def init_from_target(target: llama.Model, target_args: dict, layer_ids: list[int],
                     head_vocab: Optional[list[int]]) -> DraftModel:
    """A draft whose layers start as copies of the given target layers, sharing the target's embedding."""
    draft = DraftModel(draft_args(target_args, len(layer_ids)), head_vocab)
    draft.model.embed_tokens = target.model.embed_tokens
    for i, src in enumerate(layer_ids):
        draft.model.layers[i].update(_copy(target.model.layers[src].parameters()))
    draft.model.norm.update(_copy(target.model.norm.parameters()))
    mx.eval(draft.parameters())
    return draft


def _copy(tree):
    from mlx.utils import tree_map

    return tree_map(lambda a: mx.array(a), tree)


def own_weights(draft: DraftModel) -> dict[str, mx.array]:
    """What the draft ships: everything but the shared embedding."""
    from mlx.utils import tree_flatten

    return {k: v for k, v in tree_flatten(draft.parameters()) if not k.startswith("model.embed_tokens")}


def save_draft(draft: DraftModel, folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in own_weights(draft).items()})
    (folder / "config.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_embedded_draft(target_model: llama.Model, target_args: dict, folder: Path = ASSET_DIR) -> DraftModel:
    """The shipped draft, built on the target's embedding; float32 on CPU, float16 on a GPU."""
    meta = json.loads((folder / "config.json").read_text())
    draft = DraftModel(draft_args(target_args, meta["layers"]), meta.get("head_vocab"))
    draft.model.embed_tokens = target_model.model.embed_tokens
    dtype = mx.float16 if mx.default_device() == mx.gpu else mx.float32
    weights = {k: v.astype(dtype) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    draft.load_weights(list(weights.items()), strict=False)
    missing = set(own_weights(draft)) - set(weights)
    if missing:
        raise ValueError(f"the shipped draft lacks {sorted(missing)[:3]}")
    mx.eval(draft.parameters())
    draft.eval()
    return draft
