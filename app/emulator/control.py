"""The emulator's own control surface (never on a real worker): faults, gate, ground truth."""

from __future__ import annotations

import orjson

from app.emulator import render
from app.emulator.asgi import Receive, Scope, Send, query, read_body, respond_json
from app.emulator.faults import FaultError
from app.emulator.worker import EmulatedWorker


async def _json_object(receive: Receive, send: Send) -> dict[str, object] | None:
    try:
        body = orjson.loads(await read_body(receive) or b"{}")
    except ValueError as exc:
        await respond_json(send, 400, render.error_body(str(exc), "BadRequestError", 400))
        return None
    if not isinstance(body, dict):
        error = render.error_body("expected a JSON object", "BadRequestError", 400)
        await respond_json(send, 400, error)
        return None
    return body


async def get_faults(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    await respond_json(send, 200, worker.faults.snapshot())


async def set_faults(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """Partial update of the fault modes; ``{"clear": true}`` first resets them all."""
    body = await _json_object(receive, send)
    if body is None:
        return
    try:
        worker.faults.update(body)
    except FaultError as exc:
        await respond_json(send, 400, render.error_body(str(exc), "BadRequestError", 400))
        return
    await respond_json(send, 200, worker.faults.snapshot())


async def get_gate(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    await respond_json(send, 200, worker.gate.snapshot())


async def set_gate(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``{"hold_after_chunks": k}`` or ``{"release": true}``."""
    body = await _json_object(receive, send)
    if body is None:
        return
    try:
        if body.get("release"):
            worker.gate.release()
        elif "hold_after_chunks" in body:
            value = body["hold_after_chunks"]
            if not isinstance(value, int):
                raise FaultError("hold_after_chunks must be a non-negative integer")
            worker.gate.hold(value)
        else:
            raise FaultError('expected {"hold_after_chunks": k} or {"release": true}')
    except FaultError as exc:
        await respond_json(send, 400, render.error_body(str(exc), "BadRequestError", 400))
        return
    await respond_json(send, 200, worker.gate.snapshot())


async def get_stats(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /emulator/stats[?rid=PREFIX][&limit=N]``: totals, active rids, records."""
    params = query(scope)
    try:
        limit = int(params["limit"]) if "limit" in params else None
    except ValueError:
        await respond_json(send, 400, render.error_body("limit must be an integer", "400", 400))
        return
    active = [req.rid for req in worker.scheduler.active.values()]
    snapshot = worker.stats.snapshot(active, params.get("rid", ""), limit)
    side = worker.disagg
    if side is not None:
        # Prefill/decode disaggregation: the rooms still in flight and what became of the
        # others (``app.emulator.rooms``).
        records = list(side.book.records)
        if limit is not None:
            records = records[-limit:] if limit > 0 else []
        snapshot["rooms"] = {"mode": side.book.mode, "pending": side.pending(), "records": records}
    await respond_json(send, 200, snapshot)


async def reset_stats(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``DELETE /emulator/stats``: forget the in-memory records (the JSONL file is kept)."""
    worker.stats.reset()
    if worker.disagg is not None:
        worker.disagg.book.reset()
    await respond_json(send, 200, {"reset": True})
