"""The native-cpu backend beyond the conformance suite (which proves its attention
against the float64 reference: ``pytest conformance --backend native-cpu``): the
compile cache, the reason given without a working compiler, the thread split, and
results that do not depend on the batch or the thread count."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from kvpage_native_cpu import NativeCpuBackend, build
from paged_steps import paged_step

from kvpage.attention.metadata import AttentionMetadata, allocate_kv_cache
from kvpage.backends import get_backend, select_backend
from kvpage.errors import BackendUnavailableError
from kvpage.specs import make_attention_spec, make_cache_spec

needs_cc = pytest.mark.skipif(
    shutil.which(build.compiler().split()[0]) is None, reason="no C compiler"
)


def _spec(dtype: str = "float32"):  # type: ignore[no-untyped-def]
    return make_cache_spec(
        num_layers=1, block_size=16, num_blocks=32, dtype=dtype, kv_dtype="auto",
        layers=[dict(num_q_heads=8, num_kv_heads=4, head_dim=32)],
    )  # fmt: skip


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty library cache directory, no memoized library, and a stub kernel source
    with the library's symbols (``build.SYMBOLS``) (the build machinery is what these tests exercise;
    the real kernel takes seconds to compile and is proven by the other tests)."""
    monkeypatch.setenv("KVPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_loaded", {})
    stub = tmp_path / "stub.c"
    stub.write_text(
        f"int kvp_abi_version(void) {{ return {build.ABI}; }}\n"
        + "".join(f"void {name}(void) {{}}\n" for name in build.SYMBOLS)
    )
    monkeypatch.setattr(build, "SOURCE", stub)
    return tmp_path / "cache" / "native-cpu"


def test_missing_compiler_is_a_named_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path
) -> None:
    monkeypatch.setenv("CC", "/no/such/cc")
    b = NativeCpuBackend()
    why = b.unsupported_reasons(_spec(), torch.device("cpu"))
    assert why == ["no C compiler: CC='/no/such/cc' not found (set CC or install gcc/clang)"]
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(_spec(), "cpu", prefer="native-cpu")
    assert e.value.reasons["native-cpu"] == why
    assert select_backend(_spec(), "cpu").name == "torch"  # auto skips it
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())


def test_failing_compiler_is_a_named_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path
) -> None:
    if shutil.which("false") is None:
        pytest.skip("no `false` program")
    monkeypatch.setenv("CC", "false")
    lib, why = build.load()
    assert lib is None and why == "C compiler 'false' failed: exit status 1"
    assert not any(fresh_cache.iterdir())  # the temporary output was removed
    assert NativeCpuBackend().unsupported_reasons(_spec(), torch.device("cpu")) == [why]


def test_refusals_by_name() -> None:
    b = NativeCpuBackend()
    assert b.unsupported_reasons(_spec("float16"), torch.device("cpu")) == [
        "dtype: expected float32|bfloat16, got float16"
    ]
    assert b.unsupported_reasons(_spec(), torch.device("cuda")) == [
        "device: expected cpu, got cuda"
    ]


@needs_cc
def test_library_is_cached_by_source_compiler_and_flags(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path
) -> None:
    lib, why = build.load()
    assert lib is not None, why
    built = list(fresh_cache.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load()[0] is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    argv = build.compiler().split()
    path = shutil.which(argv[0])
    assert path is not None
    assert build.library_path(argv, path) == built[0]
    monkeypatch.setattr(build, "flags", lambda: (*build.BASE_FLAGS, "-DKVP_TEST_FLAG"))
    assert build.library_path(argv, path) != built[0]  # another flag set, another file
    monkeypatch.setattr(build, "flags", lambda: build.BASE_FLAGS)
    build.SOURCE.write_text(build.SOURCE.read_text() + "int kvp_other(void) { return 0; }\n")
    assert build.library_path(argv, path) not in (built[0],)  # another source


@needs_cc
def test_concurrent_builds_leave_one_whole_library(fresh_cache: Path) -> None:
    argv = build.compiler().split()
    path = shutil.which(argv[0])
    assert path is not None
    target = build.library_path(argv, path)
    errors: list[str] = []
    threads = [
        threading.Thread(target=lambda: errors.append(build._build(argv, target))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["", ""]
    assert [p.name for p in fresh_cache.iterdir()] == [target.name]
    assert build.load()[0] is not None


@needs_cc
@pytest.mark.parametrize(
    ("threads", "seq_lens", "query_lens"),
    [
        (2, [70, 5, 130, 33, 300, 12, 64, 90, 41], [70, 1, 20, 1, 1, 1, 3, 1, 1]),
        # 20 parts in one call (the kernel's pool takes them all at once)
        (20, [40 + 7 * i for i in range(24)], [1] * 24),
    ],
)
def test_threads_give_the_same_bits_as_one(
    threads: int, seq_lens: list[int], query_lens: list[int]
) -> None:
    b = NativeCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32)
    cache, meta, q, _ = paged_step(seq_lens, query_lens)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            plan = b.plan(meta)
            assert plan.threads == n
            _, bounds = plan.units_for(4, 2)
            assert len(bounds) == n + 1 and all(bounds[1:] > bounds[:-1])  # n busy parts
            outs.append(b.forward(q, cache, plan, spec))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@needs_cc
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch() -> None:
    b = NativeCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32, sliding_window=40)
    cache, meta, q, tables = paged_step([90, 17, 200], [90, 1, 3])
    full = b.forward(q, cache, b.plan(meta), spec)
    alone_meta = AttentionMetadata.build(
        query_lens=[3], seq_lens=[200], block_tables=[tables[2]], block_size=16
    )
    alone = b.forward(q[91:94].clone(), cache, b.plan(alone_meta), spec)
    assert torch.equal(full[91:94], alone)


@needs_cc
@pytest.mark.parametrize(("bs", "d"), [(1, 8), (7, 12), (16, 8), (16, 80), (128, 32), (5, 256)])
def test_any_block_size_and_head_dim_matches_the_torch_backend(bs: int, d: int) -> None:
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=d, logits_soft_cap=30.0)
    cache, meta, q, _ = paged_step([40, 3, 77], [40, 1, 5], bs=bs, d=d, seed=bs + d)
    torch_b, native = get_backend("torch"), NativeCpuBackend()
    want = torch_b.forward(q, cache, torch_b.plan(meta), spec)
    got = native.forward(q, cache, native.plan(meta), spec)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fast_path_matches_the_torch_backend(dtype: torch.dtype) -> None:
    """Row copies in C (strided rows of a fused projection, slot -1 skipped) store the
    same bits as the torch backend's ``write_kv``."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 16, 8, generator=g).to(dtype)
    key, value = qkv[:, 8:12], qkv[:, 12:16]
    slots = torch.tensor([5, -1, 0, 47, 17, -1])
    caches = [allocate_kv_cache(3, 16, 4, 8, dtype=dtype) for _ in range(2)]
    NativeCpuBackend().write_kv(key, value, caches[0], slots)
    get_backend("torch").write_kv(key, value, caches[1], slots)
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert caches[0].kv.abs().sum() > 0


@needs_cc
@pytest.mark.slow  # a forked torch process: ~20 s on a loaded 2-core box
def test_a_forked_child_starts_its_own_thread_pool() -> None:
    """After 2-thread use, a forked child (fork start method) runs 2-thread steps on a
    new pool instead of waiting on the parent's threads, which it does not have."""
    import multiprocessing as mp

    b = NativeCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32)
    cache, meta, q, _ = paged_step(
        [70, 5, 130, 33, 300, 12, 64, 90, 41], [70, 1, 20, 1, 1, 1, 3, 1, 1]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = b.forward(q, cache, b.plan(meta), spec)
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as pool:
            got = pool.apply_async(_child_forward, (cache, meta, q)).get(timeout=60)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(want, torch.from_numpy(got))


def _child_forward(cache, meta, q):  # type: ignore[no-untyped-def]
    torch.set_num_threads(2)
    b = NativeCpuBackend()
    spec = make_attention_spec(num_q_heads=8, num_kv_heads=4, head_dim=32)
    # a numpy array travels pickled by value; a tensor would go through torch's
    # shared-memory file descriptors, which hang in some containers (seen here)
    return b.forward(q, cache, b.plan(meta), spec).numpy()
