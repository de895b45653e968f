"""Where a request's attempts go: the dispatch seam between the retry loop and the workers.

A ``Dispatch`` answers, for one request, which workers its next attempt may go to
(``candidates``), which one it goes to (``pick``), and how the attempt is sent there
(``target``: the ``Target`` that gives the ``Attempt``'s body as its worker gets it, is told
when the attempt ended, and says which worker a retry avoids). The ``Proxy``'s retry loop
(``app.proxy.forward``) knows no more of where requests go than this.

Two implementations, chosen once by ``Proxy``:

- ``WholeWorkers`` (``whole.py``): each attempt goes to one worker, which answers it whole;
  picked by the routing policy (``policy``).
- ``Disaggregation`` (``pd.py``): each attempt goes to a prefill + decode pair (``pair.py``,
  SGLang's PD protocol), picked by the two pools' policies (``pd.*``).

Where new things plug in:

- A new routing input (a prefix-cache index, KV events, a load figure): the routing ``Policy``
  (``app.routing``) a dispatch's ``pick`` asks, fed by ``app.workers``; nothing here changes.
- A new engine (how a worker is called, aborted, whether a broken stream may go on on it):
  ``Worker.engine`` (``app.workers``); ``continues_on`` below reads it for continuations.
- A new way of serving one request on several workers (like PD): a new ``Dispatch`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.proxy.attempt import Attempt
    from app.routing.policies import RoutingContext
    from app.workers.worker import Worker

# An upstream body, in pieces sent as they are (one write).
Pieces = tuple["memoryview | bytes", ...]
# An attempt's upstream body by its rid and priority (``ParsedRequest.upstream_parts``'s shape).
Body = Callable[[str, "int | None"], Pieces]
Headers = list[tuple[bytes, bytes]]


class Job(Protocol):
    """What a dispatch reads of the request whose attempts it places (``app.proxy.job.Job``)."""

    @property
    def ctx(self) -> RoutingContext: ...

    @property
    def stream(self) -> bool: ...

    @property
    def source(self) -> str | None:
        """The request's API key, the breaker's attribution."""


class Target(Protocol):
    """How one attempt goes where its dispatch picked, and is told when it ended."""

    @property
    def prefill(self) -> Worker | None:
        """The attempt's prefill worker, when its prompt is computed on another worker."""

    def outgoing(self, attempt: Attempt, path: str, body: Pieces, headers: Headers) -> Pieces:
        """The attempt's body (``body``, its pieces) as its worker gets it, right before it is
        sent there; what else goes out with it (a pair's prefill side) starts here."""

    def close(self, attempt: Attempt) -> None:
        """The attempt ended (it settled its own outcome)."""

    def blame(self, tried: set[str], worker: Worker) -> None:
        """After a failed attempt on ``worker`` (in ``tried``): the worker a retry avoids."""


class Dispatch(Protocol):
    """Where one request's attempts go; see the module doc."""

    def candidates(self, model: str, tried: set[str], *, continuing: bool = False) -> list[Worker]:
        """The workers the next attempt may go to (not in ``tried``); ``continuing``: it goes
        on with a broken stream."""

    def has_other(self, model: str, tried: set[str]) -> bool:
        """Some worker not yet tried may take a retry."""

    def can_continue(self, model: str, tried: set[str]) -> bool:
        """Some worker not yet tried may go on with a broken stream."""

    def pick(self, ctx: RoutingContext, candidates: list[Worker]) -> Worker:
        """The worker the attempt goes to, among ``candidates`` (admission kept those with
        room)."""

    def target(self, job: Job, worker: Worker, tried: set[str]) -> Target | None:
        """How the attempt of ``job`` on ``worker`` goes there (None: it cannot, the request
        fails as with no worker)."""

    async def aclose(self) -> None:
        """At shutdown: let what still runs in the background finish, briefly."""


def continues_on(worker: Worker) -> bool:
    """Whether a broken stream may go on on ``worker``: an SGLang one (or one whose engine is
    not known yet, taken as SGLang), whose ``continue_final_message`` ``app.proxy.continuation``
    follows; vLLM's was not checked."""
    engine = worker.engine
    return engine is None or engine.name == "sglang"
