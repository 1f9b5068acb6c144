"""Backend registry and runtime selection.

Built-in backends live in this package; plugins register classes (no-arg constructor)
under the entry-point group ``kvpage.backends``. Nothing is imported until a backend
is asked for, and a plugin whose import fails becomes a *reason* (never a crash).

Selection (``select_backend``) walks a per-device priority list and returns the first
backend that reports no reasons for the spec and device. The CUDA order (triton,
cupy, numba, torch) is the order of the backend comparison benchmark in
``docs/benchmarks.md``; on CPU only the torch backend runs.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

import torch

from kvpage.attention.protocol import AttentionBackend
from kvpage.errors import BackendUnavailableError
from kvpage.specs import CacheSpec

#: entry-point group plugins register under
ENTRY_POINT_GROUP = "kvpage.backends"

#: built-in backends: name -> "module:attribute"
BUILTIN_BACKENDS: dict[str, str] = {"torch": "kvpage.backends.torch_backend:TorchBackend"}

#: ``select_backend(prefer="auto")`` order per device type (benchmarks decide the order)
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "cupy", "numba", "torch"),
    "cpu": ("torch",),
}

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


def get_backend(name: str) -> AttentionBackend:
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
            {name: ["not registered (no built-in and no 'kvpage.backends' entry point)"]},
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
    ``unsupported_reasons``, are returned as reasons.
    """
    dev = torch.device(device)
    try:
        backend = get_backend(name)
    except BackendUnavailableError as e:
        return e.reasons.get(name, [str(e)])
    try:
        return list(backend.unsupported_reasons(spec, dev))
    except Exception as e:
        return [f"unsupported_reasons raised {type(e).__name__}: {e}"]


def select_backend(
    spec: CacheSpec, device: torch.device | str, prefer: str = "auto"
) -> AttentionBackend:
    """Pick the backend that runs ``spec`` on ``device``.

    Args:
        spec: the model's cache spec (head_dim, window, soft cap, kv dtype per layer).
        device: where the cache lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        prefer: ``"auto"`` walks ``PRIORITY[device.type]``; any other value is an
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
    candidates = PRIORITY.get(dev.type, ("torch",))
    reasons: dict[str, list[str]] = {}
    for name in candidates:
        why = backend_reasons(name, spec, dev)
        if not why:
            return get_backend(name)
        reasons[name] = why
    raise BackendUnavailableError(f"no attention backend can run this spec on {dev}", reasons)


__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "PRIORITY",
    "available_backends",
    "backend_reasons",
    "get_backend",
    "select_backend",
]
