"""OpenAI-compatible HTTP serving for kvpage (extra ``server``: fastapi, uvicorn, prometheus-client).

Importing this package does not import FastAPI; ``kvpage.server.app`` does. Entry points:
``kvpage serve`` (:mod:`kvpage.server.cli`), :func:`kvpage.server.app.create_app`,
:class:`kvpage.server.runner.BackgroundServer` (a real uvicorn server in a thread).
"""

from kvpage.server.config import ServerConfig, dump_config, load_config

__all__ = ["ServerConfig", "dump_config", "load_config"]
