"""The door: the entrance of every completion surface, between the server and FastAPI's routes
above and the proxy below.

entrance.py   ``Door.serve``: a request through typed stages (ids and span; headers, key and
              tenant into a ``Visit``; the checks before the body; the body; the parsed
              request; the checks on it), then the proxy; the leases released when the
              response ends. ``checks(gw)``: the configured checks, by where they run
checks.py     the built-in checks (media type, draining, model) and the body's reading
limits.py     the key's limits and quotas (``KeyLimits``), and what an answer is charged
visit.py      ``Visit`` (one request at the door), ``Check``, ``RequestCheck`` and ``Lease``
entry.py      ``Entry`` and ``Operation``: what a surface declares per POST route (a
              ``ParsingEntry``, or a ``LoadingEntry`` that loads state to build the request)
api_keys.py, request_id.py, reject.py
              the API key, X-Request-Id, and the refusals (answered in the surface's shape,
              logged and counted)
"""
