"""``prepare_serving_process``: what ``kvpage serve`` does before serving so that the
first requests and later garbage collections do not stall the event loop."""

from __future__ import annotations

import concurrent.futures
import gc
import sys
from types import SimpleNamespace

from kvpage.server.runner import PREIMPORT, prepare_serving_process


def test_prepare_starts_the_pool_imports_lazy_modules_and_freezes_the_heap():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
    app = SimpleNamespace(state=SimpleNamespace(serving=SimpleNamespace(tokenize_pool=pool)))
    assert len(pool._threads) == 0
    try:
        prepare_serving_process(app)
        assert len(pool._threads) == 3  # every worker started before serving
        assert all(name in sys.modules for name in PREIMPORT)
        assert gc.get_freeze_count() > 0
        frozen_before = gc.get_freeze_count()
        garbage = [[] for _ in range(1000)]  # made after: not frozen
        assert gc.get_freeze_count() == frozen_before
        del garbage
        prepare_serving_process(None)  # no app: imports and freeze only
    finally:
        gc.unfreeze()
        pool.shutdown()
