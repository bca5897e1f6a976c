"""The strategy interface: what a strategy sees and what it answers.

Strategies are pure: they receive the request, a snapshot of the candidate pods,
the index's prefix match and the current time, and return a ``Decision``. They
own no sockets and read no clocks, so the same objects run in the live gateway and
in the discrete-event simulator.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvindex.types import Bound, PrefixMatch


@dataclass(slots=True)
class RouteRequest:
    """What routing may know about one request. Never holds prompt text.

    ``prefix_hashes`` are chained hashes over chunks of the rendered prompt (for
    the approximate prefix-aware strategy); ``block_keys`` are the router's
    engine-faithful block keys (for kv-aware). Either may be empty.
    """

    model: str
    request_id: str = ""
    prompt_tokens: int = 0  # known or estimated prompt length in tokens
    block_keys: Sequence[int] = ()
    prefix_hashes: Sequence[int] = ()
    session_key: str | None = None
    stream: bool = False


@dataclass(frozen=True, slots=True)
class PodView:
    """A routing-time snapshot of one healthy candidate pod."""

    id: str
    in_flight: int = 0  # requests dispatched by this gateway and not yet finished
    in_flight_prefill_tokens: int = 0  # uncached prompt tokens of those requests
    waiting: int = 0  # scraped vllm:num_requests_waiting
    running: int = 0  # scraped vllm:num_requests_running
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc (0..1)
    prefilling: int = 0  # of in_flight, requests still waiting for their first token
    # The pod's L0 size in blocks (scraped vllm:cache_config_info; 0: unknown) and the
    # blocks its KV events say it holds there (None: unknown). Without both a strategy
    # must assume the cache is full, as a serving pod's usually is.
    kv_capacity_blocks: int = 0
    kv_held_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why; everything a metric or header needs."""

    pod: str
    strategy: str
    reason: str  # bounded vocabulary, see ``Reason``
    predicted_l0_tokens: int = 0
    predicted_l1_tokens: int = 0
    predicted_l2_tokens: int = 0
    predicted_ttft_s: float | None = None
    scores: dict[str, float] = field(default_factory=dict)  # pod -> predicted TTFT or score
    # Queue-delay part of ``predicted_ttft_s``; calibration subtracts it from observed TTFT.
    predicted_queue_s: float | None = None
    # Requests running on the pod that the queue delay charged ``decode_s_per_running``
    # for; calibration fits that per-request cost from them.
    predicted_running: int = 0
    # The gateway should speculatively record ``block_keys[:speculate_blocks]`` as held
    # in L0 by ``pod`` (until the pod's own events confirm or expire them), so a burst of
    # identical requests sees the blocks before the first one finishes prefill.
    speculate_blocks: int = 0

    @property
    def predicted_cached_tokens(self) -> int:
        return self.predicted_l0_tokens + self.predicted_l1_tokens + self.predicted_l2_tokens


class Reason:
    """Label values for ``kvgate_routing_decisions_total{reason=...}``."""

    ROTATION = "rotation"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    CACHE_HIT = "cache_hit"
    LOAD_SPILL = "load_spill"
    SESSION = "session"
    FALLBACK = "fallback"


class NoCandidates(Exception):
    """Raised when a strategy is asked to choose among zero pods."""


class Need(enum.Enum):
    """What the caller must compute for a strategy before ``choose``.

    Each costs real time per request (tokenization and an index lookup are
    milliseconds on a long prompt), so a strategy declares what it reads and the
    routing core (``routing.core``) fills only that into the ``RouteRequest``.
    """

    INDEX = "index"  # token ids, block keys and the index's PrefixMatch
    PREFIX_HASHES = "prefix_hashes"  # chained hashes of chunks of the rendered prompt
    SESSION = "session"  # a session key from a header or body field


class Strategy(abc.ABC):
    """One routing policy. Implementations live one per file in ``routing.strategies``.

    A subclass declares ``needs`` (a frozenset of ``Need``; default nothing), is
    decorated with ``@register("name", aliases=...)`` (which sets ``name``), and
    implements ``pick``. ``choose`` guards the empty candidate list for all of them;
    ``observe`` learns nothing unless overridden.
    """

    name: ClassVar[str] = ""  # set by ``routing.strategy_registry.register``
    needs: ClassVar[frozenset[Need]] = frozenset()
    # True: ``observe`` is called at the request's first token, with the TTFT and no
    # engine-reported counts (``RoutingCore.learn_at_first_token``), instead of at its end.
    learns_at_first_token: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        needs = cls.__dict__.get("needs", frozenset())
        if not isinstance(needs, frozenset) or not all(isinstance(n, Need) for n in needs):
            raise TypeError(f"{cls.__name__}.needs must be a frozenset of routing.types.Need")
        # Ad-hoc flags were the contract once; a misspelt or stale one is a start-up error.
        stray = sorted(a for a in cls.__dict__ if a.startswith(("uses_", "needs_")))
        if stray:
            raise TypeError(
                f"{cls.__name__} declares {', '.join(stray)}: declare what a strategy "
                "needs as `needs = frozenset({Need.INDEX, ...})`"
            )

    def choose(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        """The pod for ``req`` among ``pods`` (the healthy candidates)."""
        if not pods:
            raise NoCandidates(req.model)
        return self.pick(req, pods, match, now)

    @abc.abstractmethod
    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        """``choose`` with at least one candidate: what each strategy implements.

        ``match`` is the index's answer when the strategy needs ``Need.INDEX`` (None
        otherwise, or when the prompt could not be tokenized); ``now`` is the caller's
        clock (monotonic seconds live, simulated seconds in the DES).
        """

    def observe(self, req: RouteRequest, decision: Decision, outcome: Outcome) -> object | None:
        """Feedback after the request finished, or at its first token where the strategy
        ``learns_at_first_token`` (calibration, affinity memory). Returns what it learnt
        (None: nothing), which ``revise`` is handed back."""
        return None

    def revise(
        self, req: RouteRequest, decision: Decision, learnt: object, outcome: Outcome
    ) -> None:
        """A request observed at its first token, with the counts its decision predicted,
        ended with other counts from the engine (the index was stale: an eviction it
        had not heard of yet). Take back ``learnt`` (``observe``'s return then) and learn
        from ``outcome``, the end's. Nothing by default."""
        return None

    def forget_pod(self, pod: str) -> None:
        """``pod`` left the fleet for good: drop what the strategy learnt about it
        (nothing by default; bounded memories would evict it in time, but a removed
        pod's state can skew how the remaining pods are priced until then)."""
        return None

    def bounds(self) -> dict[str, Bound]:
        """How full each memory the strategy keeps is (none by default)."""
        return {}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the gateway observed for one routed request."""

    ok: bool
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def load_order(pod: PodView) -> tuple[int, int, int]:
    """How loaded a pod is, for comparing: in-flight, then engine queue, then the
    uncached prompt tokens of its requests in flight."""
    return (pod.in_flight, pod.waiting + pod.running, pod.in_flight_prefill_tokens)


def least_loaded_key(pod: PodView) -> tuple[int, int, int, str]:
    """Deterministic load order: ``load_order``, then pod id."""
    return (*load_order(pod), pod.id)


def overloaded(pod: PodView, least: PodView, abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang's cache-aware balance test, applied to one preferred pod.

    Affinity yields to load only when the preferred pod has more than ``abs_threshold``
    extra requests in flight *and* more than ``rel_threshold`` times the least loaded
    pod's: a small absolute gap on idle pods and a large relative one on busy pods
    both keep affinity.
    """
    gap = pod.in_flight - least.in_flight
    return gap > abs_threshold and pod.in_flight > least.in_flight * rel_threshold
