"""What a request that omits a sampling field gets, in this order: launch-stack's flags, the
model's generation_config.json (its sampling values), the embedded model's card, OpenAI's
neutral values (temperature 1, no truncation). Each field falls back on its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from protocol.messages import SamplingDefaults
from worker.loader import EMBEDDED

FIELDS = ("temperature", "top_p", "top_k", "min_p")
# SmolLM2-135M-Instruct's model card recommends these (its package ships no generation_config.json)
EMBEDDED_CARD = {"temperature": 0.2, "top_p": 0.9}


def generation_config(spec: str) -> Optional[dict]:
    """The model's generation_config.json, from its folder or the Hugging Face cache (never fetched)."""
    if spec == EMBEDDED:
        return None
    path = Path(spec).expanduser() / "generation_config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(spec, "generation_config.json")
        except Exception:  # not a repo id, or no hub library
            return None
        path = Path(cached) if isinstance(cached, str) else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sampling_values(config: Optional[dict]) -> dict:
    """The sampling fields a generation_config.json sets (do_sample false: greedy)."""
    if not config:
        return {}
    out = {k: config[k] for k in FIELDS if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def resolve(spec: str, flags: dict, max_tokens: Optional[int] = None) -> SamplingDefaults:
    """`flags`: the launch-stack values given (None: not given)."""
    given = {k: v for k, v in flags.items() if v is not None}
    model = sampling_values(generation_config(spec))
    card = EMBEDDED_CARD if spec == EMBEDDED else {}
    values, sources = {}, []
    for name, source in ((given, "flags"), (model, "generation_config"), (card, "model_card")):
        for k in FIELDS:
            if k in name and k not in values:
                values[k] = name[k]
                sources.append(source)
    source = "+".join(dict.fromkeys(sources)) or "openai"
    values["top_k"] = int(values.get("top_k", 0))
    return SamplingDefaults(**{k: float(v) if k != "top_k" else v for k, v in values.items()},
                            max_tokens=max_tokens, source=source)
