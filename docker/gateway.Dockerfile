# syntax=docker/dockerfile:1
# dflash-gateway image: the gateway (and its SGLang DFLASH worker emulator), no torch, no GPU,
# no benchmarks (loadtest/ stays out: the image's CLI has no `bench` command).
# The OpenTelemetry SDK is in (the otel extra), so tracing.enabled works from the chart.
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t dflash-gateway:0.1.0 .
# Run (same command as `make run`, plus a bind address reachable from outside the container):
#   docker run --rm -p 8000:8000 dflash-gateway:0.1.0 --host 0.0.0.0 --worker-url http://WORKER:30000

# --- build stage: a wheel of the project and wheels of all its dependencies --------------------
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
RUN pip wheel --wheel-dir /wheels '.[otel]'

# --- runtime stage: slim Python, the wheels installed, a non-root user -------------------------
FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN groupadd --system --gid 10001 dflash \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin dflash
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links=/wheels 'dflash-gateway[otel]' \
 && rm -rf /wheels
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# /livez answers while the process is up (readiness, /readyz, also needs a healthy worker).
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["dflash-gateway", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
