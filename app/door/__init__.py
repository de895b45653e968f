"""The door: the entrance of every completion surface, between the server and FastAPI's routes
above and the proxy below.

entrance.py   ``checks(gw)``: the one ordered list of checks every request of the surface
              registry (``app.surfaces``) meets; ``Door.serve``: a request through them, then
              the proxy; the leases released when the response ends
checks.py     the checks: request id, trace, headers, key, tenant, media type, body, parse,
              draining, model
limits.py     the key's limits and quotas (``KeyLimits``), and what an answer is charged
visit.py      ``Visit`` (one request at the door), ``Check`` and ``Lease``
entry.py      ``Entry`` and ``Operation``: what a surface declares per POST route
asgi.py       ``GatewayApp``: the ASGI entry ``app.main`` builds, ahead of FastAPI
api_keys.py, request_id.py, reject.py
              the API key, X-Request-Id, and the refusals (answered in the surface's shape,
              logged and counted)
"""
