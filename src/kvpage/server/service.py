"""The serving core: validation, admission, and turning engine outputs into responses.

:class:`ServingState` is framework-free (no FastAPI import) apart from the types it is
handed; ``kvpage.server.app`` wires it to HTTP routes. All methods run on the event loop.

Request life: :meth:`ServingState.prepare` validates and tokenizes (400/404 on bad input,
no state touched) -> :meth:`ServingState.admitted` charges the tenant bucket, reserves
KV budget and, when degraded, takes a long-context slot (429 + Retry-After when refused;
everything taken is given back on the way out) -> ``state.generation.generate``
(:class:`~kvpage.server.generation.RequestGenerator`) adds the request to the engine
and yields per-choice text deltas, applying stop strings; if the consumer goes away
(client disconnect) the request is aborted at once.

Generation (``RequestGenerator.generate``, the :class:`Delta` / :class:`Usage` records,
stop strings and :func:`rejection_error`) is in :mod:`kvpage.server.generation`;
:class:`ServingState` holds one ``RequestGenerator`` (``generation``); the names are
re-exported here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpage.engine.chat import load_chat_template, model_chat_template
from kvpage.engine.params import SamplingParams
from kvpage.errors import SpecError
from kvpage.models.tokenizer_base import Tokenizer
from kvpage.server.admission import (
    Decision,
    KVBudget,
    PrioritySlots,
    TenantLimiter,
    TenantSequences,
)
from kvpage.server.auth import Authenticator
from kvpage.server.config import ServerConfig
from kvpage.server.degradation import DegradationController
from kvpage.server.engine_client import (
    EngineClient,
    LocalEngine,
    ServedCacheSpec,
    ServedEngine,
    ServedScheduler,
)
from kvpage.server.engine_loop import AsyncEngine, StepStats
from kvpage.server.generation import Delta, RequestGenerator, Usage, rejection_error
from kvpage.server.metrics import ServerMetrics
from kvpage.server.protocol import APIError, GenerationRequest
from kvpage.server.validation import max_token_bytes

if TYPE_CHECKING:
    from kvpage.engine import LLMEngine
    from kvpage.server.engine_process import EngineProcess

    def _served(engine: LLMEngine, proc: EngineProcess) -> tuple[LocalEngine, ServedEngine]:
        """mypy proves ``LLMEngine`` a LocalEngine and the engine process a ServedEngine
        (the ingress's facade: ``kvpage.cluster.ingress``)."""
        return engine, proc


_log = logging.getLogger("kvpage.server")


def chat_template_name(state: ServingState) -> str:
    """Which template renders chat requests that bring none: ``"server"``
    (``--chat-template``), ``"model"`` (the tokenizer's) or ``"kvpage"`` (plain)."""
    if state.chat_template is not None:
        return "server"
    return "model" if model_chat_template(state.tokenizer) is not None else "kvpage"


def log_template_choice(state: ServingState, generation_config_path: str | None) -> None:
    """Log at start-up which chat template and which generation defaults apply."""
    name = chat_template_name(state)
    why = {
        "server": "--chat-template",
        "model": "the model's chat_template",
        "kvpage": "kvpage's plain '{role}: {content}' template (the model has no chat_template)",
    }[name]
    _log.info("chat template: %s", why)
    if state.sampling_defaults:
        _log.info(
            "generation config %s: request defaults %s",
            generation_config_path,
            state.sampling_defaults,
        )
    else:
        _log.info("generation config: none (kvpage's request defaults)")


__all__ = [
    "APIError",
    "Charge",
    "Delta",
    "ServingState",
    "Usage",
    "engine_client_for",
    "rejection_error",
]


@dataclass
class Charge:
    """One tenant charge (see :meth:`ServingState.charged`).

    Attributes:
        started: set once every prompt is admitted and generation begins; from then
            on a cancellation (client gone) keeps the charge.
    """

    started: bool = False


def _cap_engine(engine: LLMEngine, cap: int) -> dict[str, int]:
    """On the engine thread (module level: the engine process pickles it)."""
    return dict(engine.scheduler.cap_max_tokens(cap))


def _rate_limited(d: Decision) -> APIError:
    headers = {"Retry-After": str(d.retry_after_s)} if d.retry_after_s is not None else {}
    return APIError(
        429, d.message, type="rate_limit_exceeded", code=d.reason, headers=headers, reason=d.reason
    )


def _served_model_len(sched: ServedScheduler) -> int:
    """The longest prompt + max_tokens served: the scheduler's ``max_servable_len`` (its
    ``max_model_len``, or less when one sequence of that length cannot fit the KV pool;
    logged)."""
    served, configured = int(sched.max_servable_len), int(sched.max_model_len)
    if served < configured:
        logging.getLogger("kvpage.server").warning(
            "max_model_len %d is served as %d: the KV cache pool holds at most %d tokens "
            "for one sequence (raise --num-blocks / the KV memory, or lower "
            "--max-model-len); longer requests are refused with context_length_exceeded",
            configured,
            served,
            served - 1,
        )
    return served


def engine_client_for(
    engine: ServedEngine, on_step: Callable[[StepStats], None] | None = None
) -> EngineClient:
    """The :class:`EngineClient` that serves ``engine``: the engine process's own
    (:meth:`EngineProcess.make_async_engine <kvpage.server.engine_process.EngineProcess.
    make_async_engine>`), else the thread loop over an engine in this process.

    Raises:
        TypeError: ``engine`` is neither (a facade over remote engines brings its own
            client: ``kvpage.cluster.ingress.ClusterState``).
    """
    from kvpage.server.engine_process import EngineProcess

    if isinstance(engine, EngineProcess):
        return engine.make_async_engine(on_step=on_step)
    if isinstance(engine, LocalEngine):
        return AsyncEngine(engine, on_step=on_step)
    raise TypeError(
        "engine: expected an LLMEngine or an EngineProcess (an engine with step(), "
        f"add_request(), ...), got {type(engine).__name__}"
    )


class ServingState:
    """Everything one server instance holds.

    Args:
        config: the server configuration.
        engine: the served engine (:class:`~kvpage.server.engine_client.ServedEngine`);
            its client is :func:`engine_client_for`'s (a subclass may bring another).
        sampling_params_cls: ``SamplingParams`` class of that engine.
        clock: monotonic clock in seconds; must agree with ``time.monotonic`` (request
            arrival times are taken with it).

    Raises:
        SpecError: the engine's model has no tokenizer.
    """

    #: export the engine loop's metric snapshot as the ``kvpage:*`` engine metrics of
    #: /metrics (a scaled-out ingress exports each replica's instead, with labels)
    export_engine_snapshot = True
    #: labels every request-level series carries besides ``model_name``
    #: (:class:`~kvpage.server.metrics.ServerMetrics`): none here; the scaled-out
    #: ingress adds ``group`` and ``replica``
    placement_labels: tuple[str, ...] = ()

    def __init__(
        self,
        config: ServerConfig,
        engine: ServedEngine,
        sampling_params_cls: Callable[..., SamplingParams],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if engine.tokenizer is None:
            raise SpecError(
                "engine.model: expected a model with a tokenizer (the server tokenizes "
                "prompts and detokenizes outputs), got one without"
            )
        self.config = config
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        #: bytes of text one token covers at most (None: unknown), for the pre-encode check
        self.max_bytes_per_token = max_token_bytes(self.tokenizer)
        #: validation + tokenization run here, off the event loop (encode can be slow)
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvpage-tokenize"
        )
        self.params_cls = sampling_params_cls
        self.clock = clock
        #: the ``--chat-template`` default (None: the model's, else kvpage's plain one)
        self.chat_template = load_chat_template(config.chat_template)
        #: generation_config.json defaults for the sampling fields a request leaves unset
        self.sampling_defaults: dict[str, Any] = dict(engine.default_sampling_params)
        log_template_choice(self, engine.generation_config_path)
        spec = engine.cache_spec
        #: the longest prompt + max_tokens served: the engine's max_model_len, or less
        #: when one sequence of that length cannot fit the KV pool (then requests are
        #: validated against the pool's limit, and the default max_tokens fits it)
        self.max_model_len = _served_model_len(engine.scheduler)
        #: the engine loop: a thread here, or the pipe to an engine process
        self.loop: EngineClient = self._engine_client(engine)
        self.metrics = ServerMetrics(
            lambda: self.loop.metrics_snapshot if self.export_engine_snapshot else {},
            float(spec.total_bytes),
            model_name=config.model_name,
            placement_labels=self.placement_labels,
        )
        self.export_cache_config()
        #: the engine's scheduling policy (``fcfs`` | ``priority``)
        self.scheduling_policy = str(engine.scheduler.policy)
        self._init_tenancy(config)
        self._init_admission(config, spec, clock)
        #: runs admitted requests on the loop (:meth:`generate`); owns the per-request
        #: degraded-mode caps and cancel causes
        self.generation = RequestGenerator(
            config, self.tokenizer, self.params_cls, clock, self.loop, self.metrics,
            self.degradation,
        )  # fmt: skip

    def _engine_client(self, engine: ServedEngine) -> EngineClient:
        """The client serving ``engine`` (:func:`engine_client_for`)."""
        return engine_client_for(engine, self._on_step)

    def _init_tenancy(self, config: ServerConfig) -> None:
        """API keys, per-tenant rate limits and in-flight sequence budgets."""
        #: API keys -> tenants (raises SpecError on a bad keys file)
        self.auth = Authenticator(config.security)
        self.auth.check_policy(self.scheduling_policy)
        cap = config.security.max_unauthenticated_tenants
        self.limiter = TenantLimiter(
            config.admission,
            self.auth.limits(),
            max_tenants=max(cap, len(self.auth.tenants)) if self.auth.enabled else cap,
        )
        #: admitted, unfinished sequences per tenant (the default fairness budget)
        self.tenant_sequences = TenantSequences(
            config.admission.max_inflight_sequences_per_tenant, config.admission.retry_after_s
        )

    def _init_admission(
        self, config: ServerConfig, spec: ServedCacheSpec, clock: Callable[[], float]
    ) -> None:
        """The KV budget, degraded mode and the counters of admitted requests."""
        #: engine steps that ran out of device or host memory
        self.num_oom = 0
        self.kv_budget = KVBudget(
            max(1, spec.num_blocks - 1), spec.block_size, config.admission, self.scheduling_policy
        )
        self.degradation = DegradationController(
            config.degradation, clock(), on_change=lambda d, _r: self.metrics.set_degraded(d)
        )
        self.long_slots = PrioritySlots(
            config.degradation.long_context_concurrency, self.scheduling_policy
        )
        self.num_long_waiting = 0
        self.num_active = 0
        self._capping: asyncio.Task[dict[str, int]] | None = None
        self._prev_snapshot: dict[str, float] = dict(self.loop.metrics_snapshot)

    def export_cache_config(self) -> None:
        """Set the ``kvpage:cache_config`` info series from the engine's cache spec."""
        spec = self.engine.cache_spec
        self.metrics.cache_config.info(
            {
                "block_size": str(spec.block_size),
                "num_blocks": str(spec.num_blocks),
                "kv_dtype": str(spec.kv_dtype),
                "backend": str(self.engine.backend_name),
                "model": self.config.model_name,
            }
        )

    def effective_config(self) -> dict[str, Any]:
        """``GET /admin/config``: the running configuration with what start-up decided
        pinned (:func:`kvpage.server.resolved.resolve_server`; secrets excluded) and
        this machine's facts."""
        from kvpage.server.resolved import resolve_server

        cfg = resolve_server(self.config, self.engine)
        facts = cfg.resolved_on or {}
        return {"config": cfg.model_dump(mode="json"), "machines": {"server": facts}}

    # ------------------------------------------------------------ engine thread hook
    def _on_step(self, st: StepStats) -> None:
        if st.failed:
            self.metrics.step_failures.inc()
        if st.oom:
            self.num_oom += 1
            self.metrics.oom.inc()
        prev, cur = self._prev_snapshot, st.metrics
        self._prev_snapshot = dict(cur)
        self.metrics.step_running.observe(cur.get("kvpage:num_requests_running", 0.0))
        self.metrics.step_waiting.observe(cur.get("kvpage:num_requests_waiting", 0.0))
        if st.duration_s <= 0:
            return
        dp = cur.get("kvpage:prompt_tokens_total", 0.0) - prev.get(
            "kvpage:prompt_tokens_total", 0.0
        )
        dg = cur.get("kvpage:generation_tokens_total", 0.0) - prev.get(
            "kvpage:generation_tokens_total", 0.0
        )
        if dp > 0:
            self.metrics.prefill_tps.observe(dp / st.duration_s)
        if dg > 0:
            self.metrics.decode_tps.observe(dg / st.duration_s)

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``: 200 while the engine loop runs, else 503, with the
        degradation state. Reads two flags: never waits on the engine or a pool."""
        ok = self.loop.running
        body = {
            "status": "ok" if ok else "engine loop not running",
            "degraded": self.degradation.degraded,
        }
        return (200 if ok else 503), body

    # ------------------------------------------------------------ periodic control
    def tick(self) -> None:
        """Evaluate degradation and refresh gauges (called every ``eval_interval_s``)."""
        now = self.clock()
        snap = self.loop.metrics_snapshot
        # An out-of-memory step weighs as much as a window of allocation failures at the
        # enter rate: one OOM is enough to enter degraded mode.
        deg = self.config.degradation
        oom_weight = self.num_oom * deg.enter_alloc_failures_per_s * deg.window_s
        self.degradation.record_alloc_failures_total(
            snap.get("kvpage:block_allocation_failures_total", 0.0) + oom_weight, now
        )
        self.degradation.evaluate(now)
        cap = self.config.degradation.max_tokens_cap
        if self.degradation.degraded and cap is not None and self._capping is None:
            with contextlib.suppress(RuntimeError):  # no running event loop: nothing to cap
                self._capping = asyncio.get_running_loop().create_task(self.cap_admitted(cap))
        self.tick_gauges()

    async def cap_admitted(self, cap: int) -> dict[str, int]:
        """Degraded mode acting on admitted work: cap the ``max_tokens`` of every request
        already in the engine at ``cap`` (``Scheduler.cap_max_tokens``, run on the engine
        thread between steps); their responses say so when they finish
        (``kvpage_max_tokens_capped`` on the final chunk/body, ``finish_reason:
        "length"``; ``generation.capped_running``). An engine loop without a local engine (the
        scaled-out ingress) caps nothing: only requests admitted while degraded are
        capped there. Returns request id -> new ``max_tokens``."""
        try:
            got = await self.loop.call(functools.partial(_cap_engine, cap=cap))
        except RuntimeError:
            got = {}
        finally:
            self._capping = None
        for rid, n in dict(got or {}).items():
            self.generation.capped_running[rid] = int(n)
        return dict(got or {})

    def tick_gauges(self) -> None:
        """Refresh the gauges derived from the engine snapshot and the admission state."""
        snap = self.loop.metrics_snapshot
        m = self.metrics
        m.update_from_engine(snap)
        m.queue_length.labels(queue="kv_pressure").set(self.kv_budget.num_queued)
        m.queue_length.labels(queue="long_context").set(self.num_long_waiting)
        m.kv_util.labels(kind="projected").set(self.kv_budget.projected_usage())
        m.active.set(self.num_active)

    # ------------------------------------------------------------ admission
    def cap_max_tokens(self, req: GenerationRequest) -> None:
        """Cap ``req.max_tokens`` when degraded (remembering the asked value)."""
        capped = self.degradation.cap_max_tokens(req.max_tokens)
        if capped != req.max_tokens:
            req.requested_max_tokens = req.max_tokens
            req.max_tokens = capped
            self.metrics.max_tokens_capped.inc()

    @contextlib.asynccontextmanager
    async def charged(self, reqs: list[GenerationRequest]) -> AsyncIterator[Charge]:
        """Charge the tenant once for ``reqs`` (the prompts of ONE HTTP request).

        Caps every ``max_tokens`` when degraded, then takes the summed cost from the
        tenant bucket as one unit: refused -> nothing charged, nothing started. On the
        way out the whole charge is refunded when the block raised an :class:`APIError`
        (a refusal by the KV budget, the long-context queue or the engine, or an engine
        failure), or anything else (cancelled, client gone) before
        :attr:`Charge.started` was set; a request that reached the engine and was then
        abandoned by its client keeps its charge (docs/serving.md, Admission).

        The tenant also holds the requests' sequences (``n`` per prompt) against
        ``admission.max_inflight_sequences_per_tenant`` until the block ends, however it
        ends (:class:`~kvpage.server.admission.TenantSequences`).

        Raises:
            APIError: 429 ``tenant_concurrency`` (the tenant holds too many sequences;
                checked first, nothing charged), ``tenant_rate_limit`` (with
                ``Retry-After``) or ``cost_exceeds_burst`` (without: the summed cost
                can never pass).
        """
        for r in reqs:
            self.cap_max_tokens(r)
        tenant, cost = reqs[0].tenant, sum(r.cost for r in reqs)
        sequences = sum(r.n for r in reqs)
        held = self.tenant_sequences.try_hold(tenant, sequences)
        if not held.ok:
            raise _rate_limited(held)
        try:
            d = self.limiter.try_take(tenant, cost, self.clock())
            if not d.ok:
                raise _rate_limited(d)
            charge = Charge()
            try:
                yield charge
            except BaseException as e:
                if isinstance(e, APIError) or not charge.started:
                    self.limiter.refund(tenant, cost, self.clock())
                raise
        finally:
            self.tenant_sequences.release(tenant, sequences)

    @contextlib.asynccontextmanager
    async def admitted(
        self, req: GenerationRequest, charge: Charge | None = None
    ) -> AsyncIterator[None]:
        """Admit ``req`` for the duration of the ``async with`` block.

        Without ``charge``, first charges the tenant for ``req`` alone (see
        :meth:`charged`); with one, the caller charged it already (several prompts of
        one request, charged as one unit). Then reserves KV budget and (degraded, long
        context) a long-context slot, given back on exit.

        Raises:
            APIError: 429 with ``Retry-After`` when refused.
        """
        if charge is None:
            async with self.charged([req]) as own, self.admitted(req, own):
                own.started = True
                yield
            return
        n_prompt = len(req.prompt_token_ids)
        blocks = self.kv_budget.blocks_for(n_prompt, req.max_tokens, req.n)
        d = await self.kv_budget.acquire(n_prompt, blocks, req.priority)
        if not d.ok:
            raise _rate_limited(d)
        slot = False
        try:
            if self.degradation.degraded and self.kv_budget.is_long(n_prompt):
                self.num_long_waiting += 1
                try:
                    await asyncio.wait_for(
                        self.long_slots.acquire(req.priority), self.config.admission.queue_timeout_s
                    )
                    slot = True
                except asyncio.TimeoutError:
                    raise _rate_limited(
                        Decision(
                            False,
                            "long_context_queue",
                            self.config.admission.retry_after_s,
                            "long-context queue (degraded mode): expected a free slot within "
                            f"{self.config.admission.queue_timeout_s:g}s, got none",
                        )
                    ) from None
                finally:
                    self.num_long_waiting -= 1
            self.num_active += 1
            try:
                yield
            finally:
                self.num_active -= 1
        finally:
            if slot:
                self.long_slots.release()
            self.kv_budget.release(blocks)
