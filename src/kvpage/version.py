"""The kvpage version (one source: ``kvpage.__version__`` and ``GET /version`` read it)."""

__version__ = "0.1.0"
