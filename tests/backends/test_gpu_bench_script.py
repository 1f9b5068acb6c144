"""The one-shot GPU script (benches/gpu) checked on CPU: the comparison driver runs end to
end in its dry-run mode and writes a complete JSON and markdown report; the shell
script parses and (slow) runs in dry-run mode."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benches" / "gpu"


def _driver():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("backend_compare", GPU / "backend_compare.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_backend_compare_dry_run_writes_complete_report(tmp_path):
    numba_sim = importlib.util.find_spec("numba") is not None
    backends = "torch,numba,cupy" if numba_sim else "torch,cupy"
    rc = _driver().main(["--out", str(tmp_path), "--dry-run", "--backends", backends])
    assert rc == 0
    res = json.loads((tmp_path / "backend_compare.json").read_text())
    assert res["dry_run"] and res["copy_bandwidth"]["gbps"] > 0
    assert "cupy" in res["refused"]  # no GPU here: refused with its reason, not a crash
    rows = res["rows"]
    cases = {(r["mode"], r["kv"], r["batch"], r["context"]) for r in rows}
    assert len(cases) == 2 * 2 * 2 * 2  # mode x kv dtype x batch x context
    ran = [r for r in rows if r.get("backend") == "torch"]
    assert len(ran) == 16 and all(r["seconds"] > 0 and r["pct_copy_bw"] > 0 for r in ran)
    # every backend that ran agrees with SDPA on the same (dequantized) K/V
    for r in rows:
        if r.get("backend") not in (None, "sdpa_contiguous"):
            assert "error" not in r, r
            if "max_abs_err" in r:
                assert r["max_abs_err"] < 5e-2, r
    md = (tmp_path / "backend_compare.md").read_text()
    for title in ("## decode, KV bf16", "## decode, KV fp8_e4m3", "## prefill, KV bf16"):
        assert title in md
    assert "| 2 | 20 | torch |" in md


def test_driver_refuses_gpu_mode_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _driver().main(["--out", str(tmp_path)]) == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_run_all_parses():
    res = subprocess.run(["bash", "-n", str(GPU / "run_all.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_run_all_dry_run(tmp_path):
    res = subprocess.run(
        ["bash", str(GPU / "run_all.sh"), str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    lines = summary.strip().splitlines()
    assert lines and all(line.endswith("exit 0") for line in lines), summary
    assert "merge comparison: exit 0" in summary and "conformance torch: exit 0" in summary
    assert (tmp_path / "backend_compare.md").is_file()


def test_merge_unites_per_backend_runs(tmp_path):
    drv = _driver()
    base = dict(
        date="2026-11-29", info={"device": "cuda", "name": "X"}, shape={"head_dim": 128},
        copy_bandwidth={"gbps": 100.0, "bytes": 1.0, "seconds": 1.0}, dry_run=False,
        wall_seconds=10.0,
    )  # fmt: skip
    case = dict(mode="decode", kv="bf16", batch=1, context=512, query_len=1, kv_bytes=1000)
    sdpa = dict(case, backend="sdpa_contiguous", seconds=1e-5, kv_gbps=0.1, pct_copy_bw=0.1)
    parts = []
    for name, extra in (("cupy", {"seconds": 2e-5}), ("numba", {"error": "boom"})):
        d = tmp_path / name
        d.mkdir()
        row = dict(case, backend=name, seconds=extra.get("seconds"), **{k: v for k, v in extra.items() if k == "error"})  # fmt: skip
        res = dict(base, refused={} if name == "cupy" else {"triton": ["x"]}, rows=[sdpa, row])
        (d / "backend_compare.json").write_text(json.dumps(res))
        parts.append(str(d))
    assert drv.main(["--out", str(tmp_path / "all"), "--merge", *parts]) == 0
    merged = json.loads((tmp_path / "all" / "backend_compare.json").read_text())
    assert [r["backend"] for r in merged["rows"]] == ["sdpa_contiguous", "cupy", "numba"]
    assert merged["refused"] == {"triton": ["x"]} and merged["wall_seconds"] == 20.0
    md = (tmp_path / "all" / "backend_compare.md").read_text()
    assert "| 1 | 512 | numba | - |" in md and "boom" in md
