"""--adapter-path: a LoRA adapter in mlx-lm's format on the served model. It changes the output
and the cache identity, /v1/models names it, and prefix reuse never serves the base model's
snapshots to the adapted one (nor one adapter's to another of the same shapes)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from cli.client import complete
from stack import Stack
from worker.engine import cache_identity
from worker.loader import AdapterError, load_model

PROMPT = "the quick brown fox"


def build_adapter(base: Path, out: Path, seed: int, scale: float = 4.0) -> Path:
    """A random LoRA adapter for `base` (lora_b non-zero, so the output changes), written as
    mlx-lm writes one: adapter_config.json and adapters.safetensors."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    out.mkdir(parents=True, exist_ok=True)
    lora = {"rank": 4, "scale": scale, "dropout": 0.0}
    model = load_model(str(base)).model
    linear_to_lora_layers(model, 2, lora)
    key = mx.random.key(seed)
    weights = {}
    for name, v in tree_flatten(model.parameters()):
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            key, sub = mx.random.split(key)
            weights[name] = 0.3 * mx.random.normal(v.shape, key=sub)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2,
                                                          "lora_parameters": lora}))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return build_adapter(tiny_llama, root / "style", seed=1), build_adapter(tiny_llama, root / "other" / "style", seed=2)


def chat(url: str, model: str | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    return complete(url, {**body, **({"model": model} if model else {})})


def test_an_adapter_changes_the_identity_and_the_id(tiny_llama, tiny_llama_lm, adapters):
    one, other = adapters
    lm, lm2 = load_model(str(tiny_llama), adapter_path=str(one)), load_model(str(tiny_llama), adapter_path=str(other))
    assert lm.model_id == f"{tiny_llama_lm.model_id}+style"
    ids = {cache_identity(x) for x in (tiny_llama_lm, lm, lm2)}
    assert len(ids) == 3  # the same shapes and name, other values: another identity
    assert lm.revision == tiny_llama_lm.revision  # the base's own identity is unchanged (a draft pairs with it)


def test_a_folder_that_is_no_adapter_is_refused_by_name(tiny_llama, tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_model(str(tiny_llama), adapter_path=str(tmp_path))


def test_adapted_stack_answers_otherwise_and_reuses_no_base_snapshot(tiny_llama, adapters, tmp_path):
    spill = tmp_path / "spill"
    with Stack(str(tiny_llama), "--cache-dir", str(spill)) as base:
        base_answers = [chat(base.url) for _ in range(2)]
        assert base_answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # reuse is on
    assert any(spill.iterdir())  # the base's snapshots stay in the spill directory
    with Stack(str(tiny_llama), "--cache-dir", str(spill), "--adapter-path", str(adapters[0])) as st:
        with urllib.request.urlopen(st.url + "/v1/models", timeout=10) as r:
            ids = [c["id"] for c in json.loads(r.read())["data"]]
        assert ids == [f"{tiny_llama.name}+style"]
        first = chat(st.url, ids[0])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the base's snapshots are not its
        assert first["choices"][0]["message"]["content"] != base_answers[0]["choices"][0]["message"]["content"]
        again = chat(st.url)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own are
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert st.exit_code == 0, st.log()
