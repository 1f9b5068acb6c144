"""The built-in ``torch`` attention backend (CPU and CUDA)."""

from kvpage.backends.torch_backend.backend import TorchBackend

__all__ = ["TorchBackend"]
