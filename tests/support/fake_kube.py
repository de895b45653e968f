"""A small Kubernetes API server for EndpointSlices: list + watch on loopback, with the failure
modes discovery must survive (a delete the watch never reports, a compacted resourceVersion)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.support.procs import free_port

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(
    name: str,
    pods: list[tuple[str, str]],
    *,
    service: str = "dflash-workers",
    port: int = 30000,
    ready: bool = True,
    terminating: bool = False,
    serving: bool | None = None,
    bootstrap_port: int | None = None,
) -> dict[str, Any]:
    """A Service's EndpointSlice; ``bootstrap_port``: a prefill Service's second port, named
    ``bootstrap`` as the chart names it."""
    ports: list[dict[str, Any]] = [{"name": "http", "port": port, "protocol": "TCP"}]
    if bootstrap_port is not None:
        ports.append({"name": "bootstrap", "port": bootstrap_port, "protocol": "TCP"})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {
                    "ready": ready,
                    "serving": ready if serving is None else serving,
                    "terminating": terminating,
                },
                "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
            }
            for pod, ip in pods
        ],
    }


class FakeKubeApi:
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.oldest_watchable = 0
        self.lists = 0
        self.watches = 0
        self.generation = 0
        self.tokens_seen: list[str] = []
        self._changed = asyncio.Condition()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route(PATH.format(namespace=namespace), self._endpoint)])
        self._server = uvicorn.Server(
            # A bounded graceful stop: open watches are cancelled and their connections closed,
            # so no transport is left for the garbage collector to complain about.
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeKubeApi:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)

    # --- what tests do to the cluster -------------------------------------------------------
    async def put(self, obj: dict[str, Any]) -> None:
        kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
        await self._record(kind, obj)

    async def delete(self, name: str, *, missed: bool = False) -> None:
        """Delete a slice; with ``missed`` the watch never hears of it (a lost event)."""
        obj = self.slices.pop(name)
        if missed:
            self.version += 1
            return
        await self._record("DELETED", obj, keep=False)

    async def compact(self) -> None:
        """Forget history and end open watches (as an API server restart does): a watch from an
        older resourceVersion gets an ERROR event with 410 Gone."""
        self.oldest_watchable = self.version
        self.generation += 1
        async with self._changed:
            self._changed.notify_all()

    async def _record(self, kind: str, obj: dict[str, Any], keep: bool = True) -> None:
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        if keep:
            self.slices[obj["metadata"]["name"]] = obj
        self.events.append((self.version, {"type": kind, "object": obj}))
        async with self._changed:
            self._changed.notify_all()

    # --- the API ------------------------------------------------------------------------------
    async def _endpoint(self, request: Request) -> Response:
        self.tokens_seen.append(request.headers.get("authorization", ""))
        selector = request.query_params.get("labelSelector", "")
        if request.query_params.get("watch") in ("1", "true"):
            since = int(request.query_params.get("resourceVersion") or 0)
            timeout = float(request.query_params.get("timeoutSeconds") or 30)
            return StreamingResponse(self._watch(since, timeout, selector))
        self.lists += 1
        items = [s for s in self.slices.values() if self._matches(s, selector)]
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @staticmethod
    def _matches(obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def _watch(self, since: int, timeout: float, selector: str) -> AsyncIterator[bytes]:
        self.watches += 1
        generation = self.generation
        if since < self.oldest_watchable:
            gone = {
                "type": "ERROR",
                "object": {"kind": "Status", "code": 410, "message": "too old resource version"},
            }
            yield orjson.dumps(gone) + b"\n"
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        cursor = since
        while True:
            for version, event in self.events:
                if version > cursor and self._matches(event["object"], selector):
                    yield orjson.dumps(event) + b"\n"
            cursor = max([cursor, *(v for v, _ in self.events)])
            remaining = deadline - loop.time()
            if remaining <= 0 or generation != self.generation:
                return
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
