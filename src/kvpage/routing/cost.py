"""The weights of the ``kv_precise`` router's cost (:class:`CostWeights`), apart from the
policy that uses them (``kvpage.routing.policies.KVPrecisePolicy``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.routing.events import RoutingError


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the ``kv_precise`` cost (see :class:`KVPrecisePolicy`).

    Why these defaults (docs/serving.md, "Routing"; tuned on the simulator's Mooncake
    conversation runs, docs/benchmarks.md): a waiting request brings its *uncached*
    blocks (``B`` is their mean) and the scheduler's chunked prefill shares steps between
    requests, so it counts as half of ``B`` (``waiting=0.5``; 0.75 and 1.0 gave up hits
    for no TTFT gain); a running request mostly decodes, one token per step next to a
    prefill chunk of thousands, so it counts little (``running=0.05``); KV usage is a
    pressure signal that a full pool stalls admissions, a quarter of ``B`` at 100 %
    (``kv_usage=0.25``; 0 lost hits and TTFT p90 in the same runs: a fuller pool evicts
    the prefixes it would be chosen for).

    Tier weights (``host``, ``disk``): a leading block a replica holds only in a KV tier
    saves its prefill but costs a promotion copy, so it counts as
    ``1 - promote_s / recompute_s`` of a device block (:meth:`tier_weight`), with the
    transfer-cost model of ``kvpage.sim.tiers`` (a block costs ``bytes / bandwidth``,
    ``TRANSFER_PRESETS``) and the recompute side of ``kvpage.engine.swap``
    (``tokens / prefill_tokens_per_s``). The defaults are that ratio for Llama-3-8B
    (128 KiB of KV per token, 16-token blocks: 2 MiB a block) on an H100 (prefill
    ~37k tokens/s: ``2 x 8e9`` FLOPs per token at 0.6 of 989 TFLOPS, the simulator's
    ``StepCostModel`` rule) with the ``pcie4-nvme`` preset: host at 25 GB/s is 0.084 ms
    against 0.43 ms of prefill (weight 0.8), disk at 6 GB/s 0.35 ms (weight 0.2). Both
    stay below 1 so a device hit always wins over the same hit in a tier.

    Attributes:
        miss: cost of one prompt block the replica does not hold (must be computed).
        waiting: cost of one request waiting on the replica, in units of the mean
            uncached blocks of the requests routed so far (``B``).
        running: cost of one running request, in units of ``B``.
        kv_usage: cost of a full KV pool (usage 1.0), in units of ``B``: a replica
            near full preempts or stalls admissions.
        host: share of a device hit that a leading block held only in the host tier
            is worth (``0 <= host < 1``).
        disk: the same for the disk tier (``0 <= disk < 1``).
    """

    miss: float = 1.0
    waiting: float = 0.5
    running: float = 0.05
    kv_usage: float = 0.25
    host: float = 0.8
    disk: float = 0.2

    def __post_init__(self) -> None:
        for k in ("miss", "waiting", "running", "kv_usage", "host", "disk"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise RoutingError(f"cost.{k}: expected a number >= 0, got {v!r}")
        for k in ("host", "disk"):
            if not getattr(self, k) < 1:
                raise RoutingError(f"cost.{k}: expected a number < 1, got {getattr(self, k)!r}")

    def medium_weight(self, medium: str) -> float:
        """What one leading block held in ``medium`` is worth (device 1.0)."""
        return 1.0 if medium == "device" else float(getattr(self, medium))

    @staticmethod
    def tier_weight(
        block_nbytes: int, bandwidth: float, block_size: int, prefill_tokens_per_s: float
    ) -> float:
        """``max(0, 1 - promote_s / recompute_s)`` for one block: ``promote_s =
        block_nbytes / bandwidth`` (bytes, bytes/s; ``kvpage.sim.tiers``),
        ``recompute_s = block_size / prefill_tokens_per_s`` (``kvpage.engine.swap``).
        Use it to set ``host`` / ``disk`` for another model or machine."""
        promote = block_nbytes / bandwidth
        recompute = block_size / prefill_tokens_per_s
        return max(0.0, 1.0 - promote / recompute)


__all__ = ["CostWeights"]
