"""tests/models: run torch single-threaded (tiny models; on a shared 2-core machine
intra-op threads only add contention — measured ~25x slower with the default)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
