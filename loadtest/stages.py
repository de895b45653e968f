"""Where a gateway process's CPU goes, by stage of a request, from a py-spy raw profile.

    py-spy record -p <gateway pid> -r 250 --format raw -o gw.raw      # while load runs
    python -m loadtest.stages gw.raw [--units N --cpu-s S]

Each sample is charged to the stage of its innermost frame that belongs to one (the first match
walking from the leaf to the root): the proxy's request objects, the upstream client, metrics...
Samples with no Python frame but the event loop's own are the loop and the kernel I/O it does
outside any request frame. With ``--units`` (requests or chunks in the profiled run) and
``--cpu-s`` (the process's CPU seconds over it) each share is also given in µs per unit.
py-spy's default (blocking) sampling is needed: ``--nonblocking`` loses most frames under load.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

# (stage, pattern of a frame's function name), most specific first.
STAGES = [
    (
        "metrics (prometheus_client, the request's series)",
        r"^(Metrics\.|Counter\.|Histogram\.|MutexValue|MetricWrapperBase|observe_gaps|"
        r"Proxy\._record|TokenWindow|CollapseDetector)",
    ),
    ("access record and log", r"^(AccessLog|AccessRecord|Proxy\._note)"),
    (
        "request checks: headers, key, tenant, body, validation, upstream body",
        r"^(parse_request|_openai\.|read_body|client_headers|check_media_type|check_model|"
        r"routing_key|request_id_of|echo_id_of|key_name|Tenants\.|admit|release|_decode|_check_|"
        r"_head|ParsedRequest\.|bearer|RoutingContext|Job\.|Visit\.|Door\._job|KeyLimits\.|"
        r"_release$|(MediaType|Accepting|Model)\.check$)",
    ),
    (
        "admission and routing",
        r"^(Admission\.|WorkerPool\.|LeastInflight|PrefixAffinity|\w*Policy\.|FairQueue)",
    ),
    (
        "upstream client: request write, response parse, pool",
        r"^(UpstreamClient\.|Http1Client\.|Http1Response\.|Connection\.)",
    ),
    (
        "answer: usage and meta_info read, stream relay, write to the client",
        r"^(relay_whole|read_answer|Downstream\.|ResponseLane\.|relay_stream|SSEObserver)",
    ),
    (
        "supervision and attempt bookkeeping",
        r"^(Supervisor\.|Attempt\.|CancelScope\.|AttemptGuard|Breaker|Worker\.|Tally)",
    ),
    (
        "HTTP server: uvicorn's protocol and ASGI cycle, the connection guard",
        r"^(HttpToolsProtocol\.|HttpConnection\.|HeadMeter\.|GuardedConnection\.|RequestResponseCycle\.|"
        r"GatewayApp\.|FlowControl)",
    ),
    (
        "request coroutines' own lines (serve_entry, Proxy.run...)",
        r"^(Proxy\.|Door\.serve|serve_entry)",
    ),
]
_COMPILED = [(name, re.compile(pattern)) for name, pattern in STAGES]
LOOP = "event loop and kernel I/O outside a request frame"


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in _COMPILED:
            if pattern.match(frame):
                return name
    return LOOP if frames and frames[-1] == "Runner.run" else "other"


def tally(lines: list[str]) -> Counter[str]:
    """Samples per stage; ``lines``: py-spy's raw format (``frame;frame;... count``)."""
    stages: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if stack:
            stages[stage_of([f.split(" (")[0] for f in stack.split(";")])] += int(count)
    return stages


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stages", description=__doc__)
    p.add_argument("profile", type=Path)
    p.add_argument("--units", type=float, help="requests (or chunks) in the profiled run")
    p.add_argument("--cpu-s", type=float, help="the process's CPU seconds over that run")
    args = p.parse_args(argv)
    stages = tally(args.profile.read_text().splitlines())
    if not set(stages) - {"other", LOOP}:
        print(
            "no sample matched a stage: is this a raw py-spy profile of the gateway, from a "
            "py-spy that reports qualified names (Class.method)?",
            file=sys.stderr,
        )
        return 1
    total = sum(stages.values())
    for name, samples in stages.most_common():
        share = samples / total
        per_unit = ""
        if args.units and args.cpu_s:
            per_unit = f" {share * args.cpu_s / args.units * 1e6:7.1f} µs"
        print(f"{share * 100:5.1f}%{per_unit}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
