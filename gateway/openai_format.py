"""OpenAI wire shapes: responses, stream chunks, usage and error objects."""

from __future__ import annotations

import time
from typing import Optional

import msgspec

from protocol import messages as m

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, code: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}


def metrics_dict(metrics: m.RequestMetrics) -> dict:
    return msgspec.structs.asdict(metrics)


def usage(metrics: m.RequestMetrics) -> dict:
    return {
        "prompt_tokens": metrics.prompt_tokens,
        "completion_tokens": metrics.completion_tokens,
        "total_tokens": metrics.prompt_tokens + metrics.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": metrics.reused_tokens},
    }


class Shaper:
    """Builds the response objects of one request for its endpoint (chat or completion)."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finished: m.Finished) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason(finished.finish_reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(self.object), "choices": [choice], "usage": usage(finished.metrics),
                "metrics": metrics_dict(finished.metrics)}

    def chunk(self, text: Optional[str] = None, role: bool = False, finished: Optional[m.Finished] = None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason(finished.finish_reason) if finished else None}
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._base(self.object + ".chunk" if self.chat else self.object), "choices": [choice]}
        if finished is not None:
            out["metrics"] = metrics_dict(finished.metrics)
        return out

    def usage_chunk(self, finished: m.Finished) -> dict:
        return {**self._base(self.object + ".chunk" if self.chat else self.object), "choices": [],
                "usage": usage(finished.metrics), "metrics": metrics_dict(finished.metrics)}


def finish_reason(reason: str) -> str:
    # OpenAI has no "cancelled"/"error"; a cancelled request's client is gone anyway
    return reason if reason in ("stop", "length") else "stop"
