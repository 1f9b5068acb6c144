"""``benches/bench_peers.py``'s llama.cpp engine without a llama.cpp binary: the refusal
when no ``llama-server`` is given, the ``/completion`` payload and server command
line, and the GGUF conversion (``benches/peers/convert_gguf.py``) of a tiny Llama
folder read back with gguf-py's reader (skipped when gguf-py is not importable)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    return _load("peers_worker", BENCHES / "peers" / "worker.py")


@pytest.fixture(scope="module")
def conv() -> ModuleType:
    return _load("peers_convert_gguf", BENCHES / "peers" / "convert_gguf.py")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCHES))
    try:
        return _load("bench_peers", BENCHES / "bench_peers.py")
    finally:
        sys.path.remove(str(BENCHES))


def test_llamacpp_refused_without_server(bench: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--llama-server PATH or set KVPAGE_LLAMA_SERVER"):
        bench.llama_server_path(None, {})
    with pytest.raises(ValueError, match="not an executable file"):
        bench.llama_server_path(str(tmp_path / "missing"), {})
    with pytest.raises(ValueError, match="not an executable file"):
        bench.llama_server_path(None, {"KVPAGE_LLAMA_SERVER": str(tmp_path / "missing")})
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert bench.llama_server_path(None, {"KVPAGE_LLAMA_SERVER": str(exe)}) == str(exe)
    assert bench.llama_server_path(str(exe), {}) == str(exe)


def test_main_refuses_llamacpp_by_name(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVPAGE_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--engines", "kvpage,llamacpp"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert "engine llamacpp needs llama-server" in capsys.readouterr().err
    monkeypatch.setattr(
        sys, "argv", ["bench_peers.py", "--engines", "kvpage,vllm", "--concurrency", "1"]
    )
    with pytest.raises(SystemExit):
        bench.main()
    assert "--concurrency is implemented for engines" in capsys.readouterr().err


def test_completion_payload(worker: ModuleType) -> None:
    body = worker.completion_payload((1, 5, 9), 7)
    assert (body["prompt"], body["n_predict"]) == ([1, 5, 9], 7)
    assert body["temperature"] == 0.0 and body["top_k"] == 1  # greedy
    assert body["ignore_eos"] and not body["cache_prompt"]  # exact length, no reuse
    assert body["return_tokens"] and not body["stream"]
    json.dumps(body)  # plain JSON


def test_server_argv(worker: ModuleType) -> None:
    spec = {"server": "/x/llama-server", "model": "m.gguf", "num_requests": 64, "threads": 2}
    argv = worker.llama_server_argv({**spec, "dtype": "bfloat16", "max_model_len": 512}, 8080)
    opt = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert argv[0] == "/x/llama-server" and "--cont-batching" in argv
    assert "--no-warmup" not in argv
    assert opt["--parallel"] == "64" and opt["--ctx-size"] == str(64 * 512)
    assert opt["--threads"] == opt["--threads-batch"] == "2"
    assert opt["--cache-type-k"] == opt["--cache-type-v"] == "bf16"
    argv = worker.llama_server_argv(
        {**spec, "dtype": "float32", "max_model_len": 512, "parallel": 1}, 1
    )
    opt = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert opt["--parallel"] == "1" and opt["--ctx-size"] == "512"
    assert opt["--cache-type-k"] == "f32"


def test_rope_pairs_order_keeps_the_rotation(conv: ModuleType) -> None:
    """Rotate-half rope of ``x`` equals adjacent-pair rope of the reordered ``x``
    (reordered the same way), for every head: the row order is the right one."""
    heads, d, pos = 3, 8, 5
    rng = np.random.default_rng(0)
    x = rng.standard_normal(heads * d)
    ang = pos * 10000.0 ** (-np.arange(d // 2) * 2 / d)
    c, s = np.cos(ang), np.sin(ang)
    xh = x.reshape(heads, d)
    a, b = xh[:, : d // 2], xh[:, d // 2 :]
    half = np.concatenate([a * c - b * s, b * c + a * s], axis=1).reshape(-1)
    order = conv.rope_pairs_order(heads, d)
    y = x[order].reshape(heads, d)
    e, o = y[:, 0::2], y[:, 1::2]
    pairs = np.empty_like(y)
    pairs[:, 0::2], pairs[:, 1::2] = e * c - o * s, o * c + e * s
    np.testing.assert_allclose(pairs.reshape(-1), half[order])


def _tiny_llama(folder: Path, dtype: str) -> dict:
    """A 2-layer Llama folder (config.json + model.safetensors), random weights."""
    import torch
    from safetensors.torch import save_file

    hid, inter, hq, hkv, hd, vocab, layers = 16, 24, 4, 2, 4, 40, 2
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    shapes = {"model.embed_tokens.weight": (vocab, hid), "model.norm.weight": (hid,)}
    shapes["lm_head.weight"] = (vocab, hid)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hid,),
            p + "post_attention_layernorm.weight": (hid,),
            p + "self_attn.q_proj.weight": (hq * hd, hid),
            p + "self_attn.k_proj.weight": (hkv * hd, hid),
            p + "self_attn.v_proj.weight": (hkv * hd, hid),
            p + "self_attn.o_proj.weight": (hid, hq * hd),
            p + "mlp.gate_proj.weight": (inter, hid),
            p + "mlp.up_proj.weight": (inter, hid),
            p + "mlp.down_proj.weight": (hid, inter),
        }
    sd = {k: torch.randn(v, generator=g).to(dt) for k, v in shapes.items()}
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    cfg = {
        "model_type": "llama",
        "hidden_size": hid,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": hq,
        "num_key_value_heads": hkv,
        "head_dim": hd,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return sd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_round_trip(conv: ModuleType, tmp_path: Path, dtype: str) -> None:
    try:
        gguf = conv.import_gguf()
    except ImportError as e:
        pytest.skip(f"gguf-py not importable: {e}")
    import torch

    sd = _tiny_llama(tmp_path / "tiny", dtype)
    out = conv.convert(tmp_path / "tiny", tmp_path / "tiny.gguf")
    r = gguf.GGUFReader(str(out))
    got = {t.name: t for t in r.tensors}
    assert len(got) == len(sd) == 3 + 9 * 2
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, 2)
    q = gguf.GGMLQuantizationType
    for key, t in sd.items():
        name = names.get_name(key, try_suffixes=(".weight",))
        g = got[name]
        assert list(reversed(g.shape.tolist())) == list(t.shape)  # GGUF lists ne[0] first
        want = q.BF16 if dtype == "bfloat16" and t.dim() == 2 else q.F32
        assert g.tensor_type == want
        ref = t.float()
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = t.shape[0] // 4
            ref = ref[torch.from_numpy(conv.rope_pairs_order(heads, 4))]
        data = np.asarray(g.data)
        if want == q.BF16:  # raw 16-bit patterns: the high half of a float32
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(data.reshape(ref.shape), ref.numpy())
    f = r.fields
    assert int(f["llama.block_count"].contents()) == 2
    assert int(f["llama.attention.head_count_kv"].contents()) == 2
    assert int(f["llama.rope.dimension_count"].contents()) == 4
    assert f["tokenizer.ggml.tokens"].contents()[:4] == ["<unk>", "<s>", "</s>", "t3"]
    assert len(f["tokenizer.ggml.tokens"].contents()) == 40
    assert f["tokenizer.ggml.add_bos_token"].contents() is False


def test_first_divergence(bench: ModuleType) -> None:
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2
    assert bench.first_divergence([], []) is None


def test_workload_bound_of_one_short_request() -> None:
    """One request, prompt 1, output 2: the prefill's FLOP at the peak plus one decode
    step, bandwidth-bound (weights + 2 tokens of KV at the given bandwidth)."""
    sys.path.insert(0, str(BENCHES))
    try:
        wb = _load("workload_bound", BENCHES / "peers" / "workload_bound.py")
    finally:
        sys.path.remove(str(BENCHES))
    peak, bw, wbytes = 1e11, 1e10, 4e8
    pre = (2 * wb.LAYER_LINEAR + 2 * wb.HEAD_LINEAR + 4 * 12 * 64 * 12) / peak
    step = (wbytes + 2 * (2 * 12 * 4 * 64 * 4)) / bw
    assert wb.group_bound_s([(1, 2)], wbytes, 4, bw, peak) == pytest.approx(pre + step)
    assert wb.LAYER_LINEAR + wb.HEAD_LINEAR == 100_073_472  # roofline's 400.3 MB / 4 B
