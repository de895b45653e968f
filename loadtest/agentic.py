"""``make bench-agentic``: an agent fleet's trace through the gateway's policies and sglang-router.

Every session (a coding agent) sends the same system prompt + tool block (``--shared-tokens``,
12k), then its own repository context (``--context-tokens`` 24k-30k), then ``--turns`` (8)
requests, each resending the whole history plus ``--new-tokens`` (~400) new ones and getting a
short answer (``--answer-tokens``). All sessions start at once; each session's turns run one
after another. Two regimes: ``fits`` (``--fits-sessions`` 64: ~1.8M tokens on 3 x 1M caches)
and ``pressure`` (``--pressure-sessions`` 96: ~3.3M).

Each target gets fresh emulated workers (``--workers`` 3, ``--speed`` 2, ``--cache-tokens`` 1M
when the emulator takes ``--max-total-tokens``) and the same trace: the gateway with each policy
of ``--policies``, the gateway with ``--replicas`` processes (each request to a random one;
they share one redis-server, when installed, as a deployment's replicas share their limits
and cache_aware's session homes), and
sglang-router 0.3.2 with its ``cache_aware`` policy (``--router``; ``pip install
sglang-router==0.3.2``). Per target: the hit rate (sum of cached_tokens / sum of prompt_tokens
from the workers' own usage, the emulators' ground truth), TTFT p50/p90/p99 (streams), the
makespan (first request to last answer) and the requests each worker got. Writes
``agentic.json`` and ``agentic.png`` to ``--out`` (and the PNG to ``docs/img/`` with
``--docs-img``). A smaller run for development: ``--fits-sessions 12 --pressure-sessions 18
--cache-tokens 200000`` keeps the ratio of the trace to the caches.

    make bench-agentic
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.processes import PYTHON, ManagedProcess, ProcessManager, free_port, start_redis
from loadtest.stats import summarize

CHARS_PER_TOKEN = 4  # the emulator's tokenizer
MODEL = "kimi-k2.5"
ROUTER = "sglang-router"
_WORDS = [
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "index",
    "worker",
    "cache",
    "prefix",
    "request",
    "token",
    "session",
    "router",
    "module",
    "config",
    "test",
    "assert",
    "raise",
    "yield",
    "async",
    "await",
    "lambda",
    "dict",
    "list",
    "tuple",
    "none",
]


def _text(rng: random.Random, tokens: int) -> str:
    words: list[str] = []
    size = 0
    goal = tokens * CHARS_PER_TOKEN
    while size < goal:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass(frozen=True)
class Trace:
    shared_tokens: int
    context_tokens: tuple[int, int]
    turns: int
    new_tokens: int
    answer_tokens: int
    seed: int

    def system(self) -> str:
        rng = random.Random(self.seed)
        tools = "\n".join(
            f"Tool {name}: {_text(rng, 60)}" for name in ("Read", "Edit", "Bash", "Grep", "Glob")
        )
        return "You are a coding agent.\n" + tools + "\n" + _text(rng, self.shared_tokens - 340)

    def context(self, session: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + session)
        low, high = self.context_tokens
        return f"Repository {session}:\n" + _text(rng, rng.randint(low, high))

    def turn(self, session: int, turn: int) -> str:
        rng = random.Random(self.seed * 7_919 + session * 131 + turn)
        return f"Step {turn}: " + _text(rng, self.new_tokens)


@dataclass
class Result:
    target: str
    regime: str
    sessions: int
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    makespan_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_worker: list[int] = field(default_factory=list)
    # The gateway's routing_decisions_total by reason, over its replicas (cache_aware).
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        ttft = summarize(self.ttft_s)
        return {
            "target": self.target,
            "regime": self.regime,
            "sessions": self.sessions,
            "hit_rate": round(self.hit_rate, 4),
            "ttft_ms": {k: round(v * 1000, 1) for k, v in ttft.as_dict().items() if k != "count"},
            "requests": ttft.count,
            "errors": self.errors,
            "makespan_s": round(self.makespan_s, 2),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "per_worker": self.per_worker,
            "decisions": self.decisions,
        }


async def _session(
    urls: list[str],
    client: httpx.AsyncClient,
    trace: Trace,
    system: str,
    index: int,
    rng: random.Random,
    result: Result,
) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": trace.context(index) + "\n" + trace.turn(index, 0)},
    ]
    for turn in range(trace.turns):
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": trace.answer_tokens,
            "stream": True,
            "temperature": 0,
            "chat_template_kwargs": {"thinking": False},
        }
        url = rng.choice(urls) + "/v1/chat/completions"
        started = time.perf_counter()
        first: float | None = None
        answer: list[str] = []
        try:
            async with client.stream(
                "POST",
                url,
                content=orjson.dumps(body),
                headers={"content-type": "application/json"},
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.errors += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    if first is None:
                        first = time.perf_counter()
                    chunk = orjson.loads(line[5:])
                    for choice in chunk.get("choices") or ():
                        answer.append((choice.get("delta") or {}).get("content") or "")
        except httpx.HTTPError:
            result.errors += 1
            return
        if first is not None:
            result.ttft_s.append(first - started)
        messages = [
            *messages,
            {"role": "assistant", "content": "".join(answer) or "ok"},
            {"role": "user", "content": trace.turn(index, turn + 1)},
        ]


async def _drive(urls: list[str], trace: Trace, sessions: int, result: Result) -> None:
    system = trace.system()
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    timeout = httpx.Timeout(600, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        await asyncio.gather(
            *(
                _session(urls, client, trace, system, i, random.Random(trace.seed + i), result)
                for i in range(sessions)
            )
        )
        result.makespan_s = time.perf_counter() - started


def _emulator_takes_cache_size() -> bool:
    out = subprocess.run(
        [PYTHON, "-m", "app", "emulate", "--help"], capture_output=True, text=True, check=False
    )
    return "--max-total-tokens" in out.stdout


def _emulators(procs: ProcessManager, args: argparse.Namespace, tag: str) -> list[ManagedProcess]:
    argv = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", str(args.speed)]
    argv += ["--log-level", "warning"]
    if args.cache_flag:
        argv += ["--max-total-tokens", str(args.cache_tokens)]
    return [procs.start(argv, name=f"emulator-{tag}-{i}") for i in range(args.workers)]


def _gateways(
    procs: ProcessManager, emulators: list[ManagedProcess], policy: str, count: int, tag: str
) -> list[ManagedProcess]:
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--policy", policy]
    for emulator in emulators:
        argv += ["--worker-url", emulator.url]
    env = {"DFLASH_GATEWAY_LOG_LEVEL": "warning"}
    redis = shutil.which("redis-server")
    if count > 1 and redis:  # replicas share their session homes (and limits) as deployed
        env["DFLASH_GATEWAY_LIMITS__REDIS_URL"] = start_redis(procs, redis, f"redis-{tag}")
    return [
        procs.start(
            argv, name=f"gateway-{tag}-{i}", ready_path="/readyz", ready_status=200, env=env
        )
        for i in range(count)
    ]


def _router(procs: ProcessManager, emulators: list[ManagedProcess], tag: str) -> ManagedProcess:
    argv = [PYTHON, "-m", "sglang_router.launch_router", "--worker-urls"]
    argv += [e.url for e in emulators]
    argv += ["--policy", "cache_aware", "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["--prometheus-port", str(free_port())]
    return procs.start(
        argv, name=f"router-{tag}", ready_path="/v1/models", ready_status=200, timeout=60
    )


def _ready(gateways: list[ManagedProcess], workers: int) -> None:
    """Every replica sees every worker healthy (the router checks its own at start)."""
    deadline = time.monotonic() + 60
    for gateway in gateways:
        while time.monotonic() < deadline:
            listed = httpx.get(gateway.url + "/workers", timeout=5).json()["workers"]
            if sum(1 for w in listed if w["state"] == "healthy") == workers:
                break
            time.sleep(0.2)


def run_target(target: str, regime: str, sessions: int, args: argparse.Namespace) -> Result:
    result = Result(target, regime, sessions)
    trace = Trace(
        args.shared_tokens,
        (args.context_min_tokens, args.context_max_tokens),
        args.turns,
        args.new_tokens,
        args.answer_tokens,
        args.seed,
    )
    tag = target.replace(" ", "").replace(":", "-")
    with tempfile.TemporaryDirectory(prefix="dflash-agentic-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            emulators = _emulators(procs, args, tag)
            if target == f"{ROUTER}:cache_aware":
                urls = [_router(procs, emulators, tag).url]
            else:
                policy, _, replicas = target.partition(" x")
                gateways = _gateways(procs, emulators, policy, int(replicas or 1), tag)
                _ready(gateways, len(emulators))
                urls = [g.url for g in gateways]
            asyncio.run(_drive(urls, trace, sessions, result))
            if not target.startswith(ROUTER):
                result.decisions = _decisions(urls)
            for emulator in emulators:
                stats = httpx.get(emulator.url + "/emulator/stats", params={"limit": 0}).json()
                totals = stats["totals"]
                result.prompt_tokens += totals["prompt_tokens"]
                result.cached_tokens += totals["cached_tokens"]
                result.per_worker.append(totals["requests"])
        finally:
            procs.stop_all()
    return result


def _decisions(urls: list[str]) -> dict[str, int]:
    """``dflash_gateway_routing_decisions_total`` by reason, summed over the gateways."""
    counts: dict[str, int] = {}
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("dflash_gateway_routing_decisions_total{"):
                labels, _, value = line.rpartition(" ")
                reason = labels.split('reason="', 1)[1].split('"', 1)[0]
                counts[reason] = counts.get(reason, 0) + int(float(value))
    return counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policies",
        default="cache_aware,prefix_affinity,spare_capacity,least_inflight",
        help="gateway policies, comma-separated",
    )
    p.add_argument("--replicas", type=int, default=3, help="gateway processes for the x N row")
    p.add_argument(
        "--replica-policy", default="cache_aware", help="policy of the replicated row ('' skips)"
    )
    p.add_argument("--no-router", action="store_true", help="skip sglang-router")
    p.add_argument("--regimes", default="fits,pressure")
    p.add_argument("--fits-sessions", type=int, default=64)
    p.add_argument("--pressure-sessions", type=int, default=96)
    p.add_argument("--shared-tokens", type=int, default=12_000)
    p.add_argument("--context-min-tokens", type=int, default=24_000)
    p.add_argument("--context-max-tokens", type=int, default=30_000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=400)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--speed", type=float, default=2.0)
    p.add_argument("--cache-tokens", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--docs-img", action="store_true", help="also write docs/img/agentic.png")


def targets(args: argparse.Namespace) -> list[str]:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.replica_policy and args.replicas > 1:
        names.append(f"{args.replica_policy} x{args.replicas}")
    if not args.no_router:
        names.append(f"{ROUTER}:cache_aware")
    return names


def table(results: list[Result]) -> str:
    head = (
        f"{'regime':<9}{'target':<26}{'hit':>6}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
        f"{'makespan':>10}{'vs router':>10}  per-worker requests"
    )
    lines = [head]
    for result in results:
        row = result.as_dict()
        router = next(
            (r for r in results if r.regime == result.regime and r.target.startswith(ROUTER)),
            None,
        )
        ratio = f"{result.makespan_s / router.makespan_s:.2f}x" if router else "-"
        ttft = row["ttft_ms"]
        lines.append(
            f"{result.regime:<9}{result.target:<26}{result.hit_rate:>6.3f}{ttft['median']:>8.0f}ms"
            f"{ttft['p90']:>6.0f}ms{ttft['p99']:>6.0f}ms{result.makespan_s:>9.1f}s{ratio:>10}  "
            f"{result.per_worker}"
            + (f"  ({result.errors} errors)" if result.errors else "")
            + (f"  {result.decisions}" if result.decisions else "")
        )
    return "\n".join(lines)


def write_png(path: Path, results: list[Result]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    regimes = list(dict.fromkeys(r.regime for r in results))
    fig, axes = plt.subplots(len(regimes), 3, figsize=(14, 3.6 * len(regimes)), squeeze=False)
    for row, regime in zip(axes, regimes, strict=True):
        ran = [r for r in results if r.regime == regime]
        names = [r.target for r in ran]
        colors = ["tab:orange" if n.startswith(ROUTER) else "tab:blue" for n in names]
        figures = (
            ([r.hit_rate for r in ran], "hit rate (cached / prompt tokens)"),
            ([summarize(r.ttft_s).median * 1000 for r in ran], "TTFT p50 (ms)"),
            ([r.makespan_s for r in ran], "makespan (s)"),
        )
        for ax, (values, title) in zip(row, figures, strict=True):
            ax.barh(names, values, color=colors)
            ax.set_title(f"{regime} ({ran[0].sessions} sessions): {title}", fontsize=9)
            ax.invert_yaxis()
            ax.tick_params(labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.cache_flag = _emulator_takes_cache_size()
    if not args.cache_flag:
        print("(the emulator has no --max-total-tokens: its fixed 1M-token cache is used)")
    sessions = {"fits": args.fits_sessions, "pressure": args.pressure_sessions}
    results: list[Result] = []
    for regime in [r.strip() for r in args.regimes.split(",") if r.strip()]:
        for target in targets(args):
            result = run_target(target, regime, sessions[regime], args)
            results.append(result)
            print(table([result]).splitlines()[1], flush=True)
    print()
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in {"out", "docs_img"}}
    document = {"meta": meta, "results": [r.as_dict() for r in results]}
    (args.out / "agentic.json").write_text(json.dumps(document, indent=2) + "\n")
    png = args.out / "agentic.png"
    problem = write_png(png, results)
    if problem:
        print(f"no plot: {problem}")
    elif args.docs_img:
        docs_png = Path(__file__).resolve().parent.parent / "docs" / "img" / "agentic.png"
        docs_png.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, docs_png)
    print(f"wrote {args.out / 'agentic.json'}" + ("" if problem else f" and {png}"))


if __name__ == "__main__":
    main()
