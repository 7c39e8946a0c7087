"""The gateway's OpenAPI document (``GET /openapi.json``) with the request bodies.

The POST routes read their JSON themselves (bounded body reading, errors in each API's own
shape), so FastAPI cannot see their pydantic models; :func:`request_body` declares a
route's model and :func:`install` adds every declared model to ``components.schemas``, so
schema-driven clients and fuzzers (e.g. schemathesis) know what each endpoint takes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}  # marker -> model (the document holds only JSON)


def request_body(model: type[BaseModel], description: str) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model`` (resolved by :func:`install`)."""
    marker = f"{model.__module__}.{model.__qualname__}"
    _MODELS[marker] = model
    return {"requestBody": {"required": True, "description": description,
                            "content": {"application/json": {"schema": {"x-deepwell-model": marker}}}},
            "responses": {"400": {"description": "invalid request (the API's own error shape)"}}}


def _models(schema: dict[str, Any]) -> list[tuple[dict[str, Any], type[BaseModel]]]:
    found = []
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            media = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            marker = media.get("schema", {}).get("x-deepwell-model")
            if marker in _MODELS:
                found.append((media, _MODELS[marker]))
    return found


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="deepwell gateway: OpenAI chat/completions/responses and Anthropic "
                                             "messages over the engines' model")
            uses = _models(schema)
            distinct = list(dict.fromkeys(model for _, model in uses))
            refs, defs = models_json_schema([(m, "validation") for m in distinct], ref_template=REF)
            for media, model in uses:
                media["schema"] = refs[(model, "validation")]
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
