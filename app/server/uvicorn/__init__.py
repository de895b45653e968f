"""Everything the gateway needs from uvicorn beyond its public ``Config``/``Server``, in one place.

``protocol`` (``HttpConnection``: one client connection, uvicorn's private httptools protocol
seen through hooks and services), ``lane`` (``ResponseLane``: one request's response written past
uvicorn's ``send``) and ``server`` (``Server``: signal handling) touch uvicorn's internals;
``head`` (a request head's raw size) is the gateway's own and knows nothing of uvicorn.
"""
