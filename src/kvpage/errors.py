"""The one error hierarchy of kvpage.

Every error a user can cause derives from :class:`KVPageError`. Messages read
``"name: expected X, got Y"`` so that the offending argument is named first.
``assert`` is used only for internal invariants, never for user input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: most characters of an offending value's repr that an error message quotes
GOT_REPR_MAX = 200


def got_repr(value: object, limit: int = GOT_REPR_MAX) -> str:
    """``repr(value)`` for the "got Y" part of an error message, at most ``limit``
    characters plus ``"... (N characters)"`` (N: the full repr's length).

    Every message that quotes a user-supplied value uses it, so a 3 MB field, a
    deeply nested list or a file's contents is never echoed back at full length.
    """
    try:
        r = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
    except ValueError:  # an int beyond sys.get_int_max_str_digits() has no repr
        if isinstance(value, int):
            return f"an int of {value.bit_length()} bits (too long to show)"
        raise
    if len(r) <= limit:
        return r
    return f"{r[:limit]}... ({len(r)} characters)"


def format_validation_error(exc: Any) -> str:
    """A pydantic ``ValidationError`` as one line per field, ``"engine.num_blocks:
    expected >= 2, got 1"`` joined with ``"; "`` (no pydantic URL). A validator's own
    ``"field: expected ..."`` message is kept as written, prefixed with where the field
    sits (``engine.``)."""
    ops = {
        "greater_than_equal": ">=",
        "greater_than": ">",
        "less_than_equal": "<=",
        "less_than": "<",
    }
    lines = []
    for err in exc.errors():
        path = [str(x) for x in err.get("loc", ())]
        ctx = err.get("ctx") or {}
        kind = err.get("type", "")
        if kind in ops:
            want = f"{ops[kind]} {next(iter(ctx.values()), '?')}"
        elif kind == "missing":
            want = "a value (required field)"
        elif kind == "extra_forbidden":
            want = "no such field (unknown option)"
        else:
            want = str(err.get("msg", "a valid value"))
            want = want.removeprefix("Input should be ").removeprefix("Value error, ")
        if kind == "value_error":
            named = want.split(": expected ", 1)[0]
            if not path or named.replace(".", "_").isidentifier():  # it names the field
                if path and path[-1] == named:
                    path.pop()
                lines.append(".".join([*path, want]))
                continue
        got = "missing" if kind == "missing" else got_repr(err.get("input"), 120)
        lines.append(f"{'.'.join(path) or 'config'}: expected {want}, got {got}")
    return "; ".join(lines)


class KVPageError(Exception):
    """Base class of every error kvpage raises on purpose."""


class SpecError(KVPageError, ValueError):
    """A model, cache or attention specification is invalid or unsupported."""


class ShapeError(KVPageError, ValueError):
    """A tensor or sequence has the wrong shape or length."""


class DTypeError(KVPageError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class IntegrityError(KVPageError, RuntimeError):
    """Internal bookkeeping of the block pool or cache manager is inconsistent.

    This signals a bug (in kvpage or in a caller that bypassed the manager); the
    message carries the numbers that disagree.
    """


class AllocationError(KVPageError, RuntimeError):
    """A block operation was used wrongly (double free, freeing the null block, ...)."""


class RequestRejected(KVPageError, ValueError):
    """A request was refused before it touched any state.

    Attributes:
        reason: short machine-readable reason, e.g. ``"empty_prompt"``,
            ``"prompt_too_long"``, ``"exceeds_kv_capacity"``, ``"invalid_sampling_params"``.
        request_id: the request's id when known.
    """

    def __init__(self, message: str, *, reason: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.request_id = request_id

    def __reduce__(self) -> tuple[object, ...]:
        # picklable with its keyword-only fields (the server's engine process sends it)
        return (_rebuild_rejected, (str(self), self.reason, self.request_id))


def _rebuild_rejected(message: str, reason: str, request_id: str | None) -> RequestRejected:
    return RequestRejected(message, reason=reason, request_id=request_id)


class BackendUnavailableError(KVPageError, RuntimeError):
    """No attention backend (or not the requested one) can run the given spec on the device.

    Attributes:
        reasons: backend name -> list of reasons that backend refused.
    """

    def __init__(self, message: str, reasons: Mapping[str, Sequence[str]]) -> None:
        lines = [message]
        for name, why in reasons.items():
            for r in why:
                lines.append(f"  {name}: {r}")
        super().__init__("\n".join(lines))
        self.reasons: dict[str, list[str]] = {k: list(v) for k, v in reasons.items()}
        self._message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (BackendUnavailableError, (self._message, self.reasons))


__all__ = [
    "AllocationError",
    "BackendUnavailableError",
    "DTypeError",
    "GOT_REPR_MAX",
    "IntegrityError",
    "KVPageError",
    "RequestRejected",
    "ShapeError",
    "SpecError",
    "format_validation_error",
    "got_repr",
]
