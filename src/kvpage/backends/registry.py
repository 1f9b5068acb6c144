"""Backend registry and runtime selection.

Built-in backends live in this package; plugins register classes (no-arg constructor)
under the entry-point group ``kvpage.backends``. Nothing is imported until a backend
is asked for, and a plugin whose import fails becomes a *reason* (never a crash).

Selection (``select_backend``) ranks every registered backend by the priority it
declares for the device type (``BackendCapabilities.priority``) and returns the first
that reports no reasons for the spec and device, so a new plugin takes part in
``"auto"`` without editing this module. The shipped CUDA order (triton 30, cupy 20,
numba 10, torch 0) is the order of the backend comparison benchmark in
``docs/benchmarks.md``; on CPU the ``numba-cpu`` plugin (10) ranks before torch (0),
by the measurement in the same file.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import torch

from kvpage.attention.canonical import mla_reasons, sinks_reasons
from kvpage.attention.protocol import AttentionBackend
from kvpage.errors import BackendUnavailableError
from kvpage.specs import CacheSpec

#: entry-point group plugins register under
ENTRY_POINT_GROUP = "kvpage.backends"

#: built-in backends: name -> "module:attribute"
BUILTIN_BACKENDS: dict[str, str] = {"torch": "kvpage.backends.torch_backend:TorchBackend"}

#: names that are not selectable backends, with the reason
_NOT_BACKENDS = {
    "reference": "the float64 reference is the test oracle, not a backend the engine can select"
}


def _plugin_entry_points() -> dict[str, EntryPoint]:
    eps: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        eps.setdefault(ep.name, ep)
    return eps


def available_backends() -> list[str]:
    """Names of every registered backend: built-ins first, then plugins (sorted).

    Registered is not runnable: use ``backend_reasons`` (or ``select_backend``) to learn
    whether a backend can run a spec on a device. Importing nothing, this never fails.
    """
    names = list(BUILTIN_BACKENDS)
    names += sorted(n for n in _plugin_entry_points() if n not in BUILTIN_BACKENDS)
    return names


def _load(name: str) -> object:
    if name in BUILTIN_BACKENDS:
        module, _, attr = BUILTIN_BACKENDS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    ep = _plugin_entry_points().get(name)
    if ep is None:
        raise KeyError(name)
    return ep.load()


def get_backend(name: str) -> AttentionBackend[Any]:
    """Instantiate the backend registered as ``name``.

    Raises:
        BackendUnavailableError: unknown name, ``"reference"``, or the plugin failed to
            import or construct (the exception text is the reason).
    """
    if name in _NOT_BACKENDS:
        raise BackendUnavailableError(
            f"backend {name!r}: not selectable", {name: [_NOT_BACKENDS[name]]}
        )
    try:
        cls = _load(name)
    except KeyError:
        raise BackendUnavailableError(
            f"backend: expected one of {available_backends()}, got {name!r}",
            {
                name: [
                    "not registered (no built-in and no 'kvpage.backends' entry point; "
                    f"registered: {', '.join(available_backends())})"
                ]
            },
        ) from None
    except Exception as e:  # a broken plugin is a reason, not a crash
        raise BackendUnavailableError(
            f"backend {name!r}: import failed", {name: [f"import failed: {type(e).__name__}: {e}"]}
        ) from e
    try:
        backend = cls()  # type: ignore[operator]
    except Exception as e:
        raise BackendUnavailableError(
            f"backend {name!r}: construction failed",
            {name: [f"construction failed: {type(e).__name__}: {e}"]},
        ) from e
    return backend  # type: ignore[no-any-return]


def backend_reasons(name: str, spec: CacheSpec, device: torch.device | str) -> list[str]:
    """Why backend ``name`` cannot run ``spec`` on ``device`` ([] = it can).

    Import and construction failures, and exceptions raised by the backend's own
    ``unsupported_reasons``, are returned as reasons; so are attention-sink layers for
    a backend that does not declare ``capabilities.sinks`` and MLA layers for one that
    does not declare ``capabilities.mla``.
    """
    dev = torch.device(device)
    try:
        backend = get_backend(name)
    except BackendUnavailableError as e:
        return e.reasons.get(name, [str(e)])
    try:
        why = list(backend.unsupported_reasons(spec, dev))
    except Exception as e:
        return [f"unsupported_reasons raised {type(e).__name__}: {e}"]
    if not getattr(backend.capabilities, "sinks", False):  # a feature it never declared
        for r in sinks_reasons(spec, name):
            if not any(w.startswith(r.split(":")[0]) for w in why):
                why.append(r)
    if not getattr(backend.capabilities, "mla", False):
        for r in mla_reasons(spec, name):
            if not any(w.startswith(r.split(":")[0]) for w in why):
                why.append(r)
    return why


def select_backend(
    spec: CacheSpec, device: torch.device | str, prefer: str = "auto"
) -> AttentionBackend[Any]:
    """Pick the backend that runs ``spec`` on ``device``.

    Args:
        spec: the model's cache spec (head_dim, window, soft cap, kv dtype per layer).
        device: where the cache lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        prefer: ``"auto"`` walks ``auto_order(device)``; any other value is an
            explicit backend name.

    Returns:
        A backend instance with no unsupported reasons.

    Raises:
        BackendUnavailableError: the explicit backend cannot run (its reasons), or no
            candidate can (every candidate's reasons).
    """
    dev = torch.device(device)
    if prefer != "auto":
        why = backend_reasons(prefer, spec, dev)
        if why:
            raise BackendUnavailableError(
                f"backend {prefer!r}: cannot run this spec on {dev}", {prefer: why}
            )
        return get_backend(prefer)
    reasons: dict[str, list[str]] = {}
    for name in auto_order(dev, reasons):
        why = backend_reasons(name, spec, dev)
        if not why:
            return get_backend(name)
        reasons[name] = why
    raise BackendUnavailableError(f"no attention backend can run this spec on {dev}", reasons)


def auto_order(
    device: torch.device | str, reasons: dict[str, list[str]] | None = None
) -> list[str]:
    """Backends ``select_backend(prefer="auto")`` tries on ``device``: every registered
    backend that declares a priority for the device type
    (``capabilities.priority[device.type]``), highest first, ties by name.

    Args:
        reasons: if given, receives why each left-out backend is left out (it failed
            to load, or declares no priority for the device type).
    """
    dev_type = torch.device(device).type
    ranked: list[tuple[int, str]] = []
    for name in available_backends():
        try:
            caps = get_backend(name).capabilities
            prio = caps.priority.get(dev_type)
        except BackendUnavailableError as e:
            if reasons is not None:
                reasons[name] = e.reasons.get(name, [str(e)])
            continue
        except Exception as e:  # a malformed plugin is a reason, not a crash
            if reasons is not None:
                reasons[name] = [f"capabilities.priority: {type(e).__name__}: {e}"]
            continue
        if prio is None:
            if reasons is not None:
                reasons[name] = [f"capabilities.priority: declares none for {dev_type} (select by name)"]  # fmt: skip
            continue
        ranked.append((-int(prio), name))
    return [name for _, name in sorted(ranked)]


__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "auto_order",
    "available_backends",
    "backend_reasons",
    "get_backend",
    "select_backend",
]
