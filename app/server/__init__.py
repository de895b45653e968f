"""Running the gateway: uvicorn set-up (run.py), the HTTP-layer guards (guard.py) over the
modules that touch uvicorn's private objects (the uvicorn/ package), several processes on
one port (processes.py), listening sockets (sockets.py), the embedded emulated workers (embedded.py)
and the metrics-only port (metricsport.py)."""
