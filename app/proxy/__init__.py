"""The request path: one completion request from the client's bytes to the worker and back.

request.py     the few fields the gateway reads (app.door parses each request with it);
               client headers split by headers.py
forward.py     Proxy: pick a worker, admit, attempt, retry before the commit point, record
supervisor.py  client disconnects, keep-alives and deadlines for one request
relay.py       the worker's response out to the client, observed in passing: one loop per stream
downstream.py  the client side: response start, chunks, errors
writer.py      how its bytes leave, chosen once per request: ASGI send or the server's lane
direct.py      the lane around ASGI send: whole answers, stream chunks straight to the socket
"""
