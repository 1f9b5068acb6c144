"""The server's OpenAPI document, with the request bodies the routes actually parse.

The generation routes read the raw body themselves (strict pydantic parsing with
OpenAI-shaped errors), so FastAPI cannot see their body models; :func:`install_openapi`
adds them (``CompletionRequest`` / ``ChatCompletionRequest`` JSON schemas) and the error
responses to ``app.openapi()``. The document is not served over HTTP (the server sets
``openapi_url=None``); tests and fuzzers (schemathesis) read it from ``app.openapi()``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvpage.server.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["install_openapi"]

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def install_openapi(app: FastAPI, model_name: str) -> None:
    """Make ``app.openapi()`` describe the POST bodies (``model`` limited to the served
    ``model_name``), bearer auth and the error responses."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return dict(app.openapi_schema)
        doc = base()
        comps = doc.setdefault("components", {}).setdefault("schemas", {})
        comps["Error"] = _ERROR
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, model in (
            ("/v1/completions", CompletionRequest),
            ("/v1/chat/completions", ChatCompletionRequest),
        ):
            schema = model.model_json_schema(ref_template=_REF)
            comps.update(schema.pop("$defs", {}))
            schema["properties"]["model"] = {"type": "string", "enum": [model_name]}
            comps[model.__name__] = schema
            op = doc["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
            errors = {"$ref": _REF.format(model="Error")}
            for code in ("400", "401", "404", "413", "415", "429"):
                op.setdefault("responses", {})[code] = {
                    "description": "error",
                    "content": {"application/json": {"schema": errors}},
                }
        for item in doc["paths"].values():
            for op in item.values():
                op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return dict(doc)

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
