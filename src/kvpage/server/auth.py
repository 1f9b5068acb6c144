"""Authentication and tenant identity of ``kvpage serve``.

A request's **tenant** is the identity its API key authenticates, never a string the
client chooses. Keys come from ``--api-key`` (repeatable; each key is its own tenant),
the ``KVPAGE_API_KEY`` environment variable, or ``--api-keys-file``, a YAML/JSON file::

    tenants:
      team-a:
        keys: ["sk-a-2026-11", "sk-a-2026-12"]   # several keys = rotation, one tenant
        rate: 2000          # optional token bucket (tokens/s and bucket size)
        burst: 20000
        priority: 0         # optional scheduling priority (lower is served earlier;
                            # needs --scheduling-policy priority unless 0)
      ops:
        keys: ["sk-ops"]
        operator: true      # may read /metrics

Keys are compared in constant time (``hmac.compare_digest`` of SHA-256 digests against
every configured key, no early exit), so the time of a refusal does not depend on how
much of a key was right. Logs and metrics name a tenant by its configured name, or for
``--api-key`` keys by ``key-`` + 12 hex digits of a domain-separated SHA-256 of the key
(non-reversible for random keys; never the key itself).

Without any key the server is *unauthenticated*: the tenant is then the Bearer token,
else the ``user`` field, else ``"anonymous"`` — client-chosen, so it separates
cooperating clients only (rate limits can be escaped by changing it). Its per-tenant
state is bounded by an LRU (:class:`kvpage.server.admission.TenantLimiter`).

The tenant's :attr:`Tenant.cache_id` is folded into the prefix-cache block hashes
(:func:`scoped_cache_salt`), through the engine's ``cache_salt`` mechanism
(:mod:`kvpage.cache.hashing`): blocks of different tenants never share a hash.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpage.errors import SpecError, got_repr
from kvpage.server.config import SecurityConfig, TenantLimit

__all__ = [
    "Authenticator",
    "Tenant",
    "bearer_token",
    "is_loopback_host",
    "key_tenant_name",
    "load_keys_file",
    "request_priority",
    "scoped_cache_salt",
]

_KEY_DOMAIN = b"kvpage.tenant.v1\x00"


def key_tenant_name(key: str) -> str:
    """Log/metrics name of an ``--api-key`` tenant: ``key-`` + 12 hex digits of
    ``sha256(b"kvpage.tenant.v1\\0" + key)`` (stable across restarts, not reversible)."""
    return "key-" + hashlib.sha256(_KEY_DOMAIN + key.encode("utf-8")).hexdigest()[:12]


def _bad_key_chars(key: str) -> str:
    """What makes ``key`` unusable in an ``Authorization`` header ("" when nothing):
    leading/trailing whitespace, inner whitespace or control characters."""
    if key != key.strip():
        return "leading or trailing whitespace"
    if any(c.isspace() for c in key):
        return "whitespace inside"
    if any(unicodedata.category(c).startswith("C") for c in key):
        return "a control character"
    return ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(_KEY_DOMAIN + key.encode("utf-8", errors="surrogatepass")).digest()


@dataclass(frozen=True)
class Tenant:
    """An authenticated identity.

    Attributes:
        name: how logs, metrics and rate limits name it (configured name or ``key-...``).
        cache_id: the identity folded into block hashes (unique per tenant).
        limit: its own token bucket, or None for the server's default.
        operator: may read ``/metrics`` when that needs a key.
        priority: its scheduling priority and the most urgent one its requests may ask
            for (lower is served earlier; 0 unless the keys file sets one).
    """

    name: str
    cache_id: str
    limit: TenantLimit | None = None
    operator: bool = False
    priority: int = 0


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    keys: list[str] = Field(min_length=1)
    rate: float | None = Field(None, gt=0)
    burst: float | None = Field(None, gt=0)
    operator: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tenants: dict[str, _TenantEntry] = Field(min_length=1)


def load_keys_file(path: str | Path) -> list[tuple[str, Tenant]]:
    """Read an API keys file; return ``(key, tenant)`` pairs.

    Raises:
        SpecError: unreadable, invalid, a key listed twice, an empty key, only one of
            rate/burst, or a file that other users can read or write (``chmod 600``).
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
        data = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        # the parser's message may quote a line of the file (a key): name the error only
        raise SpecError(
            f"api_keys_file: expected a readable YAML/JSON file, got {p} ({type(exc).__name__})"
        ) from None
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SpecError(
            f"api_keys_file: expected a file only its owner can access (chmod 600), got mode "
            f"{stat.filemode(mode)} on {p}"
        )
    try:
        doc = _KeysFile.model_validate(data)
    except ValidationError as exc:
        # name the field and the rule, never the value (it may be a key)
        errs = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ())) or 'file'}: {e.get('msg')}"
            for e in exc.errors()
        )
        raise SpecError(f"api_keys_file: expected a valid keys file, got {errs} in {p}") from None
    out: list[tuple[str, Tenant]] = []
    for name, e in doc.tenants.items():
        if (e.rate is None) != (e.burst is None):
            raise SpecError(
                f"api_keys_file: tenants.{name}: expected both rate and burst or neither, "
                f"got rate={e.rate}, burst={e.burst}"
            )
        limit = TenantLimit(rate=e.rate, burst=e.burst) if e.rate is not None else None
        tenant = Tenant(name, "name:" + name, limit, e.operator, e.priority)
        out.extend((k, tenant) for k in e.keys)
    return out


class Authenticator:
    """Maps a request's ``Authorization`` header to its tenant.

    Args:
        config: the security section (keys, keys file).

    Raises:
        SpecError: an invalid keys file, an empty key, a key with whitespace or
            control characters (it could never log in) or the same key twice.
    """

    def __init__(self, config: SecurityConfig) -> None:
        pairs: list[tuple[str, Tenant]] = []
        keys = list(config.api_keys)
        for k in keys:
            name = key_tenant_name(k)
            pairs.append((k, Tenant(name, "key:" + _digest(k).hex())))
        if config.api_keys_file:
            pairs.extend(load_keys_file(config.api_keys_file))
        for k in config.metrics_api_keys:
            pairs.append((k, Tenant("metrics-" + key_tenant_name(k)[4:], "", None, True)))
        seen: set[bytes] = set()
        self._table: list[tuple[bytes, Tenant]] = []
        for k, t in pairs:
            if not k:
                raise SpecError(f"api key of {t.name}: expected a non-empty string, got ''")
            bad = _bad_key_chars(k)
            if bad:  # never quote the key itself
                raise SpecError(
                    f"api key of {t.name}: expected no whitespace or control characters "
                    f"(HTTP strips or refuses them: such a key could never log in), got a "
                    f"key with {bad}"
                )
            d = _digest(k)
            if d in seen:
                raise SpecError(f"api keys: expected each key once, got a repeated key ({t.name})")
            seen.add(d)
            self._table.append((d, t))
        #: tenants by name (rate limits of keys-file tenants are looked up here)
        self.tenants: dict[str, Tenant] = {t.name: t for _, t in self._table}
        self.enabled = bool(keys or config.api_keys_file)
        self.has_operator_keys = any(t.operator for _, t in self._table)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant of ``token`` (a Bearer token), or None when it matches no key.

        Constant time in the token's content: every configured key's digest is compared
        with ``hmac.compare_digest``, without stopping at a match.
        """
        if token is None:
            return None
        d = _digest(token)
        found: Tenant | None = None
        for kd, t in self._table:
            if hmac.compare_digest(kd, d):
                found = t
        return found

    def check_policy(self, policy: str) -> None:
        """Refuse tenant priorities the engine cannot honour.

        Raises:
            SpecError: a tenant has a non-zero ``priority`` and ``policy`` is not
                ``"priority"`` (it would be silently ignored).
        """
        if policy == "priority":
            return
        for t in self.tenants.values():
            if t.priority != 0:
                raise SpecError(
                    f"api_keys_file: tenants.{t.name}.priority: expected 0 with "
                    f"--scheduling-policy {policy} (start the server with --scheduling-policy "
                    f"priority to use tenant priorities), got {t.priority}"
                )

    def limits(self) -> dict[str, TenantLimit]:
        """Per-tenant token buckets from the keys file (name -> limit)."""
        return {t.name: t.limit for t in self.tenants.values() if t.limit is not None}


class HeaderLookup(Protocol):
    """Request headers by lower-case name (Starlette's ``Headers``, the HTTP guard's
    view of an ASGI scope)."""

    def get(self, key: str, default: str, /) -> str: ...


def bearer_token(headers: HeaderLookup) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (case-insensitive
    scheme), or None when absent, empty or another scheme."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None


def unauthenticated_tenant(token: str | None, user: str | None) -> Tenant:
    """The tenant of a request on a server without keys: Bearer token, else ``user``,
    else ``"anonymous"`` (client-chosen: separates cooperating clients only)."""
    label = token or user or "anonymous"
    return Tenant(label, "anon:" + label)


def request_priority(tenant: Tenant, asked: int | None, policy: str) -> int:
    """The engine priority of a request of ``tenant`` that asked for ``asked``.

    Unset: the tenant's configured priority. A request may ask for a *less* urgent
    priority (a larger value) than its tenant's, never a more urgent one: the configured
    priority is the operator's grant, and a client that could lower its number would
    jump every other tenant's queue. Under ``fcfs`` only 0 (or unset) is accepted, as
    vLLM does.

    Raises:
        ValueError: ``"priority: expected ..., got ..."`` (the server answers 400).
    """
    if asked is None:
        return tenant.priority
    if policy != "priority":
        if asked != 0:
            raise ValueError(
                f"priority: expected 0 or unset (the server runs --scheduling-policy {policy}), "
                f"got {got_repr(asked)}"
            )
        return 0
    if asked < tenant.priority:
        raise ValueError(
            f"priority: expected >= {tenant.priority} (the most urgent priority this API key "
            f"may use; lower values are served earlier), got {got_repr(asked)}"
        )
    return asked


def scoped_cache_salt(
    scope: Literal["tenant", "salt", "global"], tenant: Tenant, salt: str | None
) -> str | None:
    """The ``cache_salt`` the engine gets for a request (mixed into every block hash).

    * ``tenant``: ``"t:<len>:" + tenant.cache_id`` plus ``"|s:" + salt`` when the
      request sends one: tenants never share blocks, and one tenant's salts separate its
      requests.
    * ``salt``: ``"s:" + salt`` when the request sends one (shared by every tenant that
      sends the same salt), else the tenant form.
    * ``global``: ``"s:" + salt`` or None (no salt: shared by every tenant).

    The ``t:``/``s:`` prefixes keep the forms apart (no client salt yields a tenant
    form) and the length prefix makes ``cache_id`` unambiguous whatever it contains.
    """
    if scope == "global" or (scope == "salt" and salt is not None):
        return None if salt is None else "s:" + salt
    base = "t:" + str(len(tenant.cache_id)) + ":" + tenant.cache_id
    return base if salt is None else base + "|s:" + salt


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a bind address or name) is a loopback address or ``localhost``."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
