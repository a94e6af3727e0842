"""Tiny random-weight mlx-lm models with a real byte-level BPE tokenizer, for fast CPU tests.

    path = build_tiny_model(tmp / "m", "qwen3_5", seed=1)
    model, tokenizer = mlx_lm.load(str(path))

Nothing is downloaded; everything is deterministic given (arch, seed, kwargs).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

# Small fixed corpus the BPE merges are learned from.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still be useful for tests.
Hello, world! How are you today? I am fine, thank you. What is the weather like?
Once upon a time there was a little robot who wanted to learn how to write stories.
The robot read many books, and every night it wrote a new story about the stars.
Please answer the question in one short sentence. The answer is forty two.
User: What is the capital of France? Assistant: The capital of France is Paris.
We serve language models on local machines with a cache for prompts and tokens.
def hello(name): return "Hello, " + name  # print(hello("world")) 1 2 3 4 5 6 7 8 9 10
Speculative decoding uses a small draft model to propose tokens that the target verifies.
"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
SPLIT_REGEX = (  # Qwen3.5's pre-tokenizer regex (single digits, letter runs, ...)
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
BPE_VOCAB_SIZE = 384  # 3 specials + 256 bytes + up to 125 merges

# ChatML like SmolLM2's; qwen3_5 adds Qwen3's `enable_thinking=False` empty think block.
_MESSAGES = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
)
_GEN = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
_GEN_THINK = (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
CHAT_TEMPLATES = {"llama": _MESSAGES + _GEN, "qwen3_5": _MESSAGES + _GEN_THINK}
# Qwen3.5's own: thinking on (its default) opens `<think>\n` in the generation prompt
THINKING_TEMPLATE = _MESSAGES + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

LM_HEAD_GAIN = 2.0  # logit scale
# Strength of the lm_head's bigram skeleton (see _add_bigram), tuned per arch so that a
# `noise=0.3` perturbed copy agrees with the original's greedy token ~50% of the time.
BIGRAM_STRENGTH = {"llama": 0.6, "qwen3_5": 1.3}


@functools.lru_cache(maxsize=None)
def _tokenizer_json(thinking: bool) -> str:
    """Train (once per process) a byte-level BPE on CORPUS; returns tokenizer.json text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre, trainers

    # Same pipeline transformers' Qwen3_5Tokenizer rebuilds (it ignores tokenizer.json's),
    # so raw `tokenizers` and AutoTokenizer agree for both archs.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(SPLIT_REGEX), behavior="isolated"),
                                      pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    if thinking:  # like Qwen3: atomic added tokens, but not "special" (kept when decoding)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok.to_str()


def _write_tokenizer(path: Path, arch: str, template: str | None = None) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; returns the full vocab."""
    text = _tokenizer_json(arch == "qwen3_5")
    (path / "tokenizer.json").write_text(text)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": template or CHAT_TEMPLATES[arch],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    tj = json.loads(text)
    return {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}


def _model_config(arch, hidden, layers, heads, kv_heads, vocab_size, overrides) -> dict:
    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=2 * hidden, rms_norm_eps=1e-6,
        vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    if arch == "llama":
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                **common, "rope_theta": 10000.0, **overrides}
    # Hybrid Qwen3.5: the model reads only text_config (overrides land there).
    text = {
        "model_type": "qwen3_5_text", **common, "full_attention_interval": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        **overrides,
    }
    n = text["full_attention_interval"]
    text.setdefault("layer_types", [  # informational (HF style); mlx-lm derives it from n
        "full_attention" if (i + 1) % n == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])])
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text}


def _random_weights(config: dict, seed: int, chain: list[int]) -> dict[str, mx.array]:
    """Instantiate the real mlx-lm Model for its parameter names/shapes, then fill them
    deterministically from `seed` (without touching mlx's global RNG)."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    params = tree_flatten(model_cls(args_cls.from_dict(config)).parameters())
    tied = config.get("tie_word_embeddings", False)
    keys = mx.random.split(mx.random.key(seed), len(params) + 1)
    out = {}
    for (name, p), key in zip(params, keys):
        fan_in = p.size // p.shape[0]
        if name.endswith("model.norm.weight") and tied:  # tied: final norm sets logit scale
            out[name] = mx.full(p.shape, LM_HEAD_GAIN)
        elif name.endswith("norm.weight") or name.endswith("dt_bias"):
            out[name] = mx.ones(p.shape, mx.float32)  # keep the model's neutral init
        elif name.endswith("A_log"):  # decay rates as in GatedDeltaNet.__init__
            out[name] = mx.log(mx.random.uniform(1.0, 16.0, p.shape, key=key))
        elif name.endswith("embed_tokens.weight") and not tied:  # N(0, 1) like torch
            out[name] = mx.random.normal(p.shape, key=key)
        else:  # N(0, 1/fan_in): unit-variance activations
            out[name] = mx.random.normal(p.shape, key=key) * fan_in**-0.5
    if not tied:  # (tied: plain random logits; greedy output loops sooner)
        _add_bigram(out, keys[-1], BIGRAM_STRENGTH[config["model_type"]], mx.array(chain))
    return out


def _add_bigram(w: dict, key: mx.array, beta: float, chain: mx.array) -> None:
    """Give the lm_head a "successor" skeleton: the embedding direction of token t boosts the
    logit of succ(t) (one random cycle over `chain`, the ordinary tokens), so predictions are
    confident but context-dependent, like a weak LM, and a noised copy agrees partially."""
    emb_name = next(k for k in w if k.endswith("embed_tokens.weight"))
    head_name = emb_name.replace("model.embed_tokens", "lm_head")
    order = chain[mx.random.permutation(chain.size, key=key)]  # succ(order[i]) = order[i+1]
    unit = w[emb_name] / mx.linalg.norm(w[emb_name], axis=1, keepdims=True)
    skeleton = mx.zeros_like(w[head_name]).at[mx.roll(order, -1)].add(unit[order])
    w[head_name] = LM_HEAD_GAIN * (w[head_name] + beta * skeleton)


def _perturbed(src: Path, noise: float, seed: int) -> dict[str, mx.array]:
    """src's weights + N(0, (noise * std(tensor))^2) noise, per tensor."""
    weights = mx.load(str(src / "model.safetensors"))
    keys = mx.random.split(mx.random.key(seed), len(weights))
    return {
        name: w + noise * mx.std(w) * mx.random.normal(w.shape, key=key)
        for (name, w), key in zip(sorted(weights.items()), keys)
    }


def build_tiny_model(
    path: Path, arch: str = "llama", seed: int = 0, *, hidden: int = 64,
    layers: int | None = None, heads: int = 4, kv_heads: int = 2, vocab: int | None = None,
    perturb_from: Path | None = None, noise: float = 0.0, chat_template: str | None = None, **overrides,
) -> Path:
    """Write config.json, model.safetensors (float32), tokenizer files into `path`.

    layers defaults to 2 (llama) or 4 (qwen3_5: linear, attention, linear, attention).
    With `perturb_from`, copy that model (config + tokenizer) and add relative Gaussian
    noise to its weights (a draft model resembling its target); other args are ignored
    except `seed`, which seeds the noise. `chat_template`: another template than the arch's
    (THINKING_TEMPLATE: Qwen3.5's thinking generation prompt).
    """
    if perturb_from is None and arch not in CHAT_TEMPLATES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(CHAT_TEMPLATES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if perturb_from is not None:
        for f in Path(perturb_from).iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, path / f.name)
        weights = _perturbed(Path(perturb_from), noise, seed)
    else:
        tok_vocab = _write_tokenizer(path, arch, chat_template)
        n_vocab = max(len(tok_vocab), vocab or 0)
        layers = layers if layers is not None else {"qwen3_5": 4}.get(arch, 2)
        config = _model_config(arch, hidden, layers, heads, kv_heads, n_vocab, overrides)
        config.update(bos_token_id=tok_vocab["<|im_start|>"], eos_token_id=tok_vocab["<|im_end|>"])
        (path / "config.json").write_text(json.dumps(config, indent=2))
        chain = sorted(i for t, i in tok_vocab.items() if t not in SPECIAL_TOKENS + THINK_TOKENS)
        weights = _random_weights(config, seed, chain)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


_BUILT: dict[tuple, Path] = {}


def tiny_model_dir(tmp_path_factory, arch: str = "llama", seed: int = 0, **kw) -> Path:
    """Build once per (arch, seed, kw) per pytest session under tmp_path_factory."""
    kw_key = tuple(sorted((k, repr(v)) for k, v in kw.items()))
    key = (str(tmp_path_factory.getbasetemp()), arch, seed, kw_key)
    if key not in _BUILT or not _BUILT[key].exists():
        folder = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}")
        _BUILT[key] = build_tiny_model(folder, arch, seed, **kw)
    return _BUILT[key]
