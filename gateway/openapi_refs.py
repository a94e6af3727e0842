"""What every part of the OpenAPI document shares: where a schema is referenced, and an error
response (an OpenAI error object)."""

from __future__ import annotations

REF = "#/components/schemas/{name}"


def error_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
