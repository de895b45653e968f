"""The public endpoints' OpenAPI document (``GET /openapi.json``), for clients and fuzzers:
FastAPI's routes, plus the bodies the surface registry's entries document (``app.surfaces``;
the OpenAI ones are ``app.openai.schema``'s models)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from app.config import Settings
from app.model_names import is_pattern, usable


def openapi_document(
    app: FastAPI, settings: Settings, bodies: Iterable[type[BaseModel]]
) -> dict[str, Any]:
    """Build (once) the document FastAPI serves, with the body models (``bodies``: those of the
    surface registry's routes) in its components."""
    bodies = tuple(bodies)
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description="OpenAI-compatible gateway in front of SGLang workers.",
        routes=app.routes,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in bodies:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
    fields = [schemas[model.__name__]["properties"] for model in bodies]
    for properties in fields:
        if "messages" in properties:
            properties["messages"]["maxItems"] = settings.limits.max_messages
    gateway = app.state.gateway
    served = gateway.pool.served_models()
    names = usable(served, settings.model_aliases)
    models = [name for name in names if not is_pattern(name)]
    prefixes = [re.escape(name[:-1]) for name in names if is_pattern(name)]
    if models:  # the names a request may use now (others are 404)
        for properties in fields:
            if "model" in properties and prefixes:  # a pattern alias: any name it matches
                pattern = {"type": "string", "pattern": f"^({'|'.join(prefixes)})"}
                properties["model"]["anyOf"] = [{"enum": models}, pattern]
            elif "model" in properties:
                properties["model"]["enum"] = models
    if not gateway.keys.open:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    if models:  # else built again once workers have reported their models
        app.openapi_schema = doc
    return doc
