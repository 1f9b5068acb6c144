"""Server configuration: one pydantic document that can be dumped, kept and restored.

The whole effective configuration of ``kvpage serve`` (engine knobs, admission and
degradation thresholds, bind address) is one :class:`ServerConfig`. ``kvpage serve
--dump-config`` prints it as YAML; ``kvpage serve --config FILE`` (YAML or JSON) loads it
back, so a known-good configuration can be kept in version control and restored to roll
back a bad change. Command-line flags override values read from the file.

The ``engine`` section is the engine's own :class:`~kvpage.specs.engine_config.EngineConfig`
(one model for ``LLM(...)``, this file and the command-line flags). This module imports
only pydantic, pyyaml and kvpage's torch-free specs, so it is safe to import without the
``server`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from kvpage.errors import SpecError, format_validation_error
from kvpage.specs.engine_config import EngineConfig
from kvpage.specs.engine_config import StrictModel as _Strict

__all__ = [
    "AdmissionConfig",
    "DegradationConfig",
    "EngineConfig",
    "SecurityConfig",
    "ServerConfig",
    "TenantLimit",
    "dump_config",
    "dump_mapping",
    "format_validation_error",
    "load_config",
    "read_config_file",
]


class TenantLimit(_Strict):
    """A token bucket: refills at ``rate`` tokens/s up to ``burst`` tokens."""

    rate: float = Field(gt=0)
    burst: float = Field(gt=0)


class AdmissionConfig(_Strict):
    """Admission by token budget.

    A request costs ``prompt_tokens + n * max_tokens`` tokens (the OpenAI convention of
    charging the maximum output up front). ``default_limit`` applies to every tenant not
    listed in ``tenants``; ``None`` means unlimited. With API keys the tenant is the
    identity the key authenticates (``kvpage.server.auth``); without keys it is the
    Bearer token, else the request's ``user`` field, else ``"anonymous"``.

    KV pressure: the projected KV usage is the share of blocks that all admitted,
    unfinished requests may hold at their maximum length (``n * ceil((prompt + max_tokens)
    / block_size)`` blocks each, ignoring prefix sharing, so it is an upper bound). When
    admitting a long-context request (``prompt_tokens >= long_prompt_tokens``) would push
    it above ``kv_high_water``, the request waits in a bounded queue for up to
    ``queue_timeout_s`` (``kv_pressure_action="queue"``) or is refused at once
    (``"reject"``) with 429 and ``Retry-After: retry_after_s``. Short requests still flow.

    Retention (the ``kv_retention`` request field): a request may ask for priority levels
    up to ``kv_retention_max_priority`` (0..3; 1 = no raise allowed, 0 = the field is
    refused) and raised levels must expire within ``kv_retention_max_ttl_s`` seconds;
    anything above is refused with 400 naming the field. The limit is the same for
    every tenant; the pool-wide cap is ``engine.kv_retention_max_share``.

    Request size (vLLM and OpenAI bound it too): a ``/v1/completions`` body may carry at
    most ``max_prompts_per_request`` prompts and ``n x prompts`` at most
    ``max_sequences_per_request`` sequences; more is refused with 400 naming the field
    (``prompt`` / ``n``) and the limit, before anything is tokenized. A tenant may hold
    at most ``max_inflight_sequences_per_tenant`` admitted, unfinished sequences at once
    (its requests beyond that get 429 ``tenant_concurrency`` with ``Retry-After``), so
    one tenant's fan-out cannot fill the engine's queue ahead of everyone else; ``None``
    lifts it. It must allow one request of the largest size.
    """

    default_limit: TenantLimit | None = None
    tenants: dict[str, TenantLimit] = Field(default_factory=dict)
    kv_high_water: float = Field(0.9, gt=0.0, le=1.0)
    long_prompt_tokens: int = Field(128, ge=1)
    kv_pressure_action: Literal["queue", "reject"] = "queue"
    kv_retention_max_priority: int = Field(3, ge=0, le=3)
    kv_retention_max_ttl_s: float = Field(3600.0, gt=0.0)
    queue_timeout_s: float = Field(5.0, ge=0.0)
    max_queued: int = Field(64, ge=0)
    retry_after_s: int = Field(1, ge=1)
    max_prompts_per_request: int = Field(256, ge=1)
    max_sequences_per_request: int = Field(1024, ge=1)
    max_inflight_sequences_per_tenant: int | None = Field(1024, ge=1)

    @model_validator(mode="after")
    def _one_request_fits(self) -> AdmissionConfig:
        cap = self.max_inflight_sequences_per_tenant
        if cap is not None and cap < self.max_sequences_per_request:
            raise ValueError(
                f"max_inflight_sequences_per_tenant: expected >= max_sequences_per_request "
                f"({self.max_sequences_per_request}; one request of the largest size must "
                f"fit), got {cap}"
            )
        return self


class DegradationConfig(_Strict):
    """Graceful degradation with hysteresis.

    Every ``eval_interval_s`` the controller looks at the last ``window_s`` seconds: the
    rate of block allocation failures per second (engine counter delta / window) and the p99 TTFT of
    requests that got their first token in the window. It enters the degraded state when
    either reaches its ``enter_*`` threshold, and leaves it only when both are at or below
    their (lower) ``exit_*`` thresholds and at least ``min_dwell_s`` have passed since the
    last change (hysteresis: no flapping around one threshold). While degraded,
    long-context requests go through a separate queue served ``long_context_concurrency``
    at a time, and, only when ``max_tokens_cap`` is set (default None = off), new requests
    get ``max_tokens`` capped at it. A capped response says so: header
    ``X-KVPage-Max-Tokens-Capped: <cap>``, body field ``kvpage_max_tokens_capped:
    {"requested", "cap"}`` and ``finish_reason: "length"`` on the choices it cut
    (docs/serving.md).
    """

    enabled: bool = True
    eval_interval_s: float = Field(0.5, gt=0.0)
    window_s: float = Field(10.0, gt=0.0)
    #: allocation failures per second (over ``window_s``) that enter degraded mode; a
    #: rate, not a count, so the threshold does not depend on the window or on how
    #: many engine steps a second the machine runs (the scheduler retries every step:
    #: the issue saw ~320/s under pressure; a count of 16 in 10 s fired on any)
    enter_alloc_failures_per_s: float = Field(50.0, gt=0.0)
    exit_alloc_failures_per_s: float = Field(0.0, ge=0.0)
    enter_p99_ttft_s: float = Field(5.0, gt=0.0)
    exit_p99_ttft_s: float = Field(2.0, ge=0.0)
    min_dwell_s: float = Field(5.0, ge=0.0)
    max_tokens_cap: int | None = Field(None, ge=1)
    long_context_concurrency: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _hysteresis(self) -> DegradationConfig:
        # Exit thresholds above the enter thresholds would make the state flap every tick.
        if self.exit_p99_ttft_s > self.enter_p99_ttft_s:
            raise ValueError(
                f"exit_p99_ttft_s: expected <= enter_p99_ttft_s ({self.enter_p99_ttft_s}), "
                f"got {self.exit_p99_ttft_s}"
            )
        if self.exit_alloc_failures_per_s >= self.enter_alloc_failures_per_s:
            raise ValueError(
                f"exit_alloc_failures_per_s: expected < enter_alloc_failures_per_s "
                f"({self.enter_alloc_failures_per_s}), got {self.exit_alloc_failures_per_s}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _old_counts(cls, data: Any) -> Any:
        # the count thresholds of earlier versions: refused by name, with the new field
        if isinstance(data, dict):
            for old in ("enter_alloc_failures", "exit_alloc_failures"):
                if old in data:
                    raise ValueError(
                        f"degradation.{old}: expected {old}_per_s (a rate per second over "
                        f"window_s; a count of N in window_s is N / window_s per second), "
                        f"got {old}: {data[old]!r}"
                    )
        return data


#: the JSON parser's nesting limit (pydantic's jiter refuses deeper bodies in O(depth))
JSON_MAX_DEPTH = 200


class SecurityConfig(_Strict):
    """Authentication, tenant isolation and HTTP limits (docs/serving.md, "Security").

    API keys themselves are never part of a dumped config: ``api_keys`` (from
    ``--api-key`` or ``KVPAGE_API_KEY``) is excluded from ``--dump-config``; keep keys in
    ``api_keys_file`` (a YAML/JSON file readable by the server's user only, see
    :mod:`kvpage.server.auth`).

    * With no key at all the server is unauthenticated: it refuses to bind a non-loopback
      address unless ``allow_unauthenticated`` is set, and the tenant is then the
      client-chosen Bearer token / ``user`` (at most ``max_unauthenticated_tenants``
      rate-limit buckets, least recently used evicted).
    * ``prefix_cache_scope``: ``tenant`` (default) folds the tenant identity into every
      block hash, so tenants never share KV blocks; ``salt`` shares blocks only between
      requests sending the same ``cache_salt`` (requests without one stay per-tenant);
      ``global`` shares across tenants (``cache_salt`` still separates).
    * ``metrics_host``/``metrics_port``: serve ``/metrics`` on a separate listener (and
      not on the API port). Otherwise, with keys, ``/metrics`` needs an operator key
      (``metrics_api_keys`` or a keys-file tenant with ``operator: true``; any valid key
      when no operator key exists).
    * HTTP limits: request bodies above ``max_body_bytes`` get 413, a body not received
      within ``body_timeout_s`` 408, a non-JSON ``Content-Type`` 415; a response the
      client does not read for ``send_timeout_s`` is cut (its request aborted); headers
      above ``max_header_bytes`` are refused by the HTTP parser (h11); idle keep-alive
      connections close after ``keep_alive_timeout_s``. CORS headers are sent only for
      ``allowed_origins``.
    """

    api_keys: list[str] = Field(default_factory=list, exclude=True, repr=False)
    api_keys_file: str | None = None
    metrics_api_keys: list[str] = Field(default_factory=list, exclude=True, repr=False)
    allow_unauthenticated: bool = False
    max_unauthenticated_tenants: int = Field(4096, ge=1)
    prefix_cache_scope: Literal["tenant", "salt", "global"] = "tenant"
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    allowed_origins: list[str] = Field(default_factory=list)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0.0)
    send_timeout_s: float = Field(60.0, gt=0.0)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    keep_alive_timeout_s: float = Field(75.0, gt=0.0)

    @property
    def auth_enabled(self) -> bool:
        """Whether any API key (flag, env or file) is configured."""
        return bool(self.api_keys or self.api_keys_file)


class ServerConfig(_Strict):
    """The complete configuration of ``kvpage serve``.

    ``host`` defaults to loopback (127.0.0.1): exposing the server is a deliberate act.
    ``served_model_name`` is the id ``/v1/models`` lists and requests must name; it
    defaults to ``engine.model``.
    """

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: ignore request fields outside the OpenAI/vLLM schemas instead of refusing them
    allow_unknown_fields: bool = False
    #: vLLM's ``--enable-auto-tool-choice``: chat ``tool_choice: "auto"`` (the default
    #: with ``tools``) parses the reply with ``tool_call_parser``; needs it set
    enable_auto_tool_choice: bool = False
    #: vLLM's ``--tool-call-parser``: how tool calls are found in a reply
    #: (``kvpage.engine.tool_calls.TOOL_PARSERS``)
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    #: run the engine in its own process (``kvpage.server.engine_process``), apart from
    #: the HTTP event loop and its GIL; False (default, measured better on a loaded
    #: 2-core machine: docs/benchmarks.md) = an engine thread in the server process
    engine_process: bool = False
    #: with ``engine_process``: added to the engine process's nice value (0-19), so the
    #: OS prefers the HTTP front end (``/health``, streaming) when both want a CPU
    engine_niceness: int = Field(10, ge=0, le=19)
    #: default Jinja chat template for /v1/chat/completions and /tokenize instead of
    #: the model's: a file path or the template itself (vLLM's ``--chat-template``;
    #: ``kvpage.engine.chat.load_chat_template``); None = the model's, else kvpage's
    #: plain template
    chat_template: str | None = Field(None, min_length=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    degradation: DegradationConfig = Field(default_factory=DegradationConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    #: set by ``--dump-config --resolved``: the machine facts (kvpage/torch versions,
    #: CPUs, CUDA devices, backends; ``kvpage.server.resolved.machine_facts``) the
    #: engine's pinned values were resolved on; a start elsewhere logs what differs
    resolved_on: dict[str, str] | None = None

    @model_validator(mode="after")
    def _ports_differ(self) -> ServerConfig:
        # both listeners on one port: the second bind would fail with "Address already
        # in use" (0 = any free port, never equal)
        mp = self.security.metrics_port
        if mp is not None and mp != 0 and mp == self.port:
            raise ValueError(
                f"security.metrics_port: expected a port other than port ({self.port}) "
                f"for the separate /metrics listener, got {mp}"
            )
        return self

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ServerConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "tool_call_parser: expected 'hermes' or 'llama3_json' with "
                "enable_auto_tool_choice (as vLLM), got None"
            )
        return self

    @model_validator(mode="after")
    def _served_name(self) -> ServerConfig:
        # "" would silently become engine.model; a name with spaces around it could
        # never be matched by a client
        n = self.served_model_name
        if n is not None and (not n or n != n.strip()):
            raise ValueError(
                "served_model_name: expected a non-empty name without leading/trailing "
                f"whitespace (or unset for the model's name), got {n!r}"[:300]
            )
        return self

    @property
    def model_name(self) -> str:
        """The model id clients must use."""
        return str(self.engine.model) if self.served_model_name is None else self.served_model_name


def read_config_file(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON config file (``.json`` = JSON, anything
    else YAML; an empty file = ``{}``), for :func:`load_config` and the cluster's
    deployment file.

    Args:
        what: the name errors start with (``"config"``, ``"deployment"``).

    Raises:
        SpecError: the file is unreadable, unparsable or not a mapping.
    """
    p = Path(path)
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"{what}: expected a readable YAML/JSON file, got {p} ({exc})") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{what}: expected a mapping at top level, got {type(data).__name__}")
    return data


def dump_mapping(data: dict[str, Any], fmt: Literal["yaml", "json"] = "yaml") -> str:
    """``data`` as the text :func:`read_config_file` reads back (keys sorted)."""
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    return str(yaml.safe_dump(data, sort_keys=True))


def load_config(path: str | Path) -> ServerConfig:
    """Read a :class:`ServerConfig` from a YAML or JSON file.

    Args:
        path: ``.json`` files are parsed as JSON, anything else as YAML.

    Raises:
        SpecError: the file is unreadable or does not validate (message names the field).
    """
    data = read_config_file(path)
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise SpecError(
            f"config: expected a valid ServerConfig in {Path(path)}, got "
            f"{format_validation_error(exc)}"
        ) from exc


def dump_config(config: ServerConfig, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """Serialise ``config`` completely (defaults included) so it can be restored exactly."""
    return dump_mapping(config.model_dump(mode="json"), fmt)
