"""What can go wrong below HTTP semantics when talking to a worker.

::

    TransportError
    ├── ConnectFailed          refused, unreachable, reset while connecting
    │   └── ConnectTimeout     no connection within the connect deadline
    ├── ReadTimeout            no response (or no more of it) within a deadline
    ├── ConnectionLost         the connection ended before the response did
    └── MalformedResponse      not an HTTP/1.1 response the gateway accepts: unparsable, a
                               protocol switch, a head over ``MAX_HEAD_BYTES``, bytes after
                               the end of the response, a body over a caller's limit

``app.upstream.client.map_transport_error`` turns these into ``app.errors`` at one boundary;
nothing above ``app.upstream`` sees them.
"""

from __future__ import annotations


class TransportError(Exception):
    """A failure of the connection to a worker or of the bytes it sent."""


class ConnectFailed(TransportError):
    pass


class ConnectTimeout(ConnectFailed):
    pass


class ReadTimeout(TransportError):
    pass


class ConnectionLost(TransportError):
    pass


class MalformedResponse(TransportError):
    pass
