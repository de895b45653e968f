"""The prefill server's bootstrap server, on ``--disaggregation-bootstrap-port``.

SGLang's routes (``disaggregation/common/conn.py`` ``CommonKVBootstrapServer``): ``GET /health``
("OK"), ``GET /route`` with ``prefill_dp_rank``, ``prefill_cp_rank``, ``target_tp_rank``,
``target_pp_rank`` (all -1: the ``PrefillServerInfo`` a decode server checks; a rank: its
``rank_ip``/``rank_port``; a missing one: 400 "Missing inputs for bootstrap server."; an unknown
rank: 404), other methods on ``/route``: 405. The emulated prefill server has one DP rank of
TP 8 (as the seed's ``--tp-size 8``), registered from the start, so it never answers 503.

What SGLang exchanges over ZMQ between the decode receiver and the prefill ranks is emulated here
over HTTP, under ``/kv/{room}``:

* ``POST /kv/{room}`` ``{"decode": "host:port", "rid": ...}``: D's destination for the room
  (``send_metadata``); a room still ``Bootstrapping`` turns ``WaitingForInput``. A second decode
  request for the same room is told ``Failed`` (a room names one request).
* ``GET /kv/{room}[?wait=S]``: the room's status (``KVPoll`` name, ``failure_reason``), waiting up
  to ``S`` seconds (at most 30) for it to change while it is not concluded.
* ``POST /kv/{room}/abort``: D gave up on the room (aborted, timed out): it fails
  ("Aborted by AbortReq."), and a prefill request waiting on it ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from app.emulator.asgi import TEXT, Receive, Scope, Send, query, read_body, respond, respond_json
from app.emulator.disagg import ABORTED
from app.emulator.prefill_role import PrefillSide
from app.emulator.rooms import KVPoll
from app.emulator.worker import EmulatedWorker

_RANKS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
TP_SIZE = 8
PAGE_SIZE = 64  # trtllm_mla's page size
MAX_WAIT_S = 30.0


def _side(worker: EmulatedWorker) -> PrefillSide:
    side = worker.disagg
    assert isinstance(side, PrefillSide)
    return side


async def _text(send: Send, status: int, text: str, content_type: bytes = TEXT) -> None:
    await respond(send, status, text.encode(), content_type=content_type)


async def health(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    await _text(send, 200, "OK")


def server_info(worker: EmulatedWorker) -> dict[str, Any]:
    """``PrefillServerInfo`` as SGLang's bootstrap server sends it (``dataclasses.asdict``, the
    ``None`` layout fields left out)."""
    return {
        "attn_tp_size": TP_SIZE,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": PAGE_SIZE,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
        "prefill_http_port": worker.config.port,
        "target_tp_rank": None,
        "target_tp_ranks": None,
        "target_cp_ranks": None,
        "target_pp_ranks": None,
        "required_dst_info_num": None,
        "required_prefill_response_num": None,
    }


async def route(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["method"] != "GET":
        await _text(send, 405, "Method not allowed", b"application/json")
        return
    params = query(scope)
    values = [params.get(name, "") for name in _RANKS]
    try:
        dp, cp, tp, pp = (int(v) for v in values)
    except ValueError:
        await _text(send, 400, "Missing inputs for bootstrap server.")
        return
    if (dp, cp, tp, pp) == (-1, -1, -1, -1):
        await respond_json(send, 200, server_info(worker))
        return
    if dp != 0 or cp != 0 or pp != 0 or not 0 <= tp < TP_SIZE:
        message = (
            f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
        )
        await _text(send, 404, message)
        return
    bootstrap_port = scope["server"][1] if scope.get("server") else 0
    await respond_json(send, 200, {"rank_ip": worker.config.host, "rank_port": bootstrap_port})


def _room_id(scope: Scope) -> tuple[int | None, str]:
    """``/kv/{room}[/abort]`` -> (room, action)."""
    rest = scope["path"][len("/kv/") :]
    room, _, action = rest.partition("/")
    try:
        return int(room), action
    except ValueError:
        return None, action


async def _json(receive: Receive) -> dict[str, Any]:
    try:
        body = orjson.loads(await read_body(receive) or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def kv(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    side = _side(worker)
    room_id, action = _room_id(scope)
    method = scope["method"]
    if room_id is None or action not in ("", "abort"):
        await respond_json(send, 404, {"detail": "Not Found"})
        return
    if (action, method) not in (("", "GET"), ("", "POST"), ("abort", "POST")):
        await respond_json(send, 405, {"detail": "Method Not Allowed"})
        return
    room = side.table.get(room_id)
    if action == "abort":
        await read_body(receive)
        side.table.conclude(room, KVPoll.Failed, ABORTED)
        await respond_json(send, 200, room.view())
        return
    if method == "POST":
        body = await _json(receive)
        decode, rid = str(body.get("decode") or ""), body.get("rid")
        if room.decode is not None and (room.decode, room.decode_rid) != (decode, rid):
            view = {**room.view(), "status": "Failed"}
            view["failure_reason"] = "Duplicate decode bootstrap room"
            await respond_json(send, 200, view)
            return
        room.decode, room.decode_rid = decode, rid if isinstance(rid, str) else None
        room.registered = worker.clock.time()
        if room.status == KVPoll.Bootstrapping:
            room.set(KVPoll.WaitingForInput)
        await respond_json(send, 200, room.view())
        return
    try:
        wait = min(MAX_WAIT_S, max(0.0, float(query(scope).get("wait", "0"))))
    except ValueError:
        wait = 0.0
    if wait > 0 and not room.concluded:
        await room.changed(wait)
    await respond_json(send, 200, room.view())


Handler = Callable[[EmulatedWorker, Scope, Receive, Send], Awaitable[None]]


def routes() -> dict[str, Handler]:
    return {"/health": health, "/route": route}


async def serve(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """One request on the bootstrap port."""
    path = scope["path"]
    if path.startswith("/kv/"):
        await kv(worker, scope, receive, send)
        return
    handler = routes().get(path)
    if handler is None:
        await respond_json(send, 404, {"detail": "Not Found"})
        return
    await handler(worker, scope, receive, send)
