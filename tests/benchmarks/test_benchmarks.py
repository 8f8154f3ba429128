"""The benchmark code on the tiny model: it runs, and its roofline arithmetic is right.

No timings are asserted (benchmarks measure; tests check behaviour).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from benchmarks.engine import SHAPES
from benchmarks.roofline import MachineLimits, StepCost, matmul_params, roofline_line, step_cost
from benchmarks.step_parts import StepParts
from tests.support.paths import REPO_ROOT as ROOT


def test_step_cost_counts_weights_kv_and_flops_by_hand():
    cfg = SHAPES["tiny"]  # 2 layers (layer 0 sliding, window 32; layer 1 global), D 64, N 4, K 1, H 32, F 128
    layer_mm, head_mm = matmul_params(cfg)
    assert layer_mm == 2 * (64 * 4 * 32 + 2 * 64 * 32 + 4 * 32 * 64 + 3 * 64 * 128)
    assert head_mm == 512 * 64
    # Two decode rows at context 100: layer 0 sees 32 keys, layer 1 sees 100.
    c = step_cost(cfg, jnp.bfloat16, jnp.float32, queries=[(99, 1)] * 2, logits_rows=2)
    norms = (4 * 2 * 64 + 2 * 2 * 32 + 64) * 4
    assert c.weight_bytes == (layer_mm + head_mm) * 2 + norms
    keys = 2 * (32 + 100)
    assert c.kv_bytes == (keys + 2 * 2) * 2 * 1 * 32 * 4  # read, plus 2 rows x 2 layers written
    assert c.flops == 2 * 2 * layer_mm + 2 * 2 * head_mm + 4 * 4 * 32 * keys


def test_roofline_line_reports_fractions_of_the_limits():
    limits = MachineLimits("test", 10.0, 8.0, 10.0, "measured", {"float32": 100.0})
    line = roofline_line(StepCost(5e8, 0.0, 1e9), 0.1, limits, jnp.float32)
    # memory floor 50 ms = 50% of the 100 ms step; compute floor 10 ms = 10%.
    assert "memory 50.0 ms (50% of 10 GB/s reached)" in line
    assert "compute 10.0 ms (10% of 100 GFLOP/s)" in line and "memory-bound" in line


def test_step_parts_line_splits_the_step_time():
    parts = StepParts(step=0.1, attention=0.03, head=0.05)
    assert parts.rest == pytest.approx(0.02)
    line = parts.line()
    assert "attention 30.0 ms (30%)" in line and "output head 50.0 ms (50%)" in line
    assert "rest 20.0 ms (20%)" in line
    assert parts.as_dict() == dict(step_s=0.1, attention_s=0.03, head_s=0.05, rest_s=parts.rest)


def test_engine_benchmark_runs_on_the_tiny_shape(tmp_path):
    from benchmarks import engine

    out = tmp_path / "engine.json"
    engine.main(["--shape", "tiny", "--dtype", "bfloat16", "--slots", "3", "--context", "40",
                 "--prefill", "16", "--steps", "1", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {(r["slots"], r["dtype"]) for r in report["decode"]} == {(3, "bfloat16")}
    assert [r["bucket"] for r in report["prefill"]] == [16]
    for row in report["decode"] + report["prefill"]:
        assert row["tokens_per_s"] > 0 and row["bandwidth_fraction"] > 0 and row["compute_fraction"] > 0
    for row in report["decode"]:  # where the step's time goes (benchmarks.step_parts)
        parts = row["parts"]
        assert parts["step_s"] == row["seconds"] and parts["attention_s"] > 0 and parts["head_s"] > 0
        assert parts["rest_s"] == pytest.approx(parts["step_s"] - parts["attention_s"] - parts["head_s"])
    assert report["limits"]["bandwidth_gbs"] > 0 and set(report["limits"]["matmul_gflops"]) == {"bfloat16"}


def test_engine_benchmark_builds_engines_by_cpu_kernel_setting():
    """``--cpu-kernels off on``: each engine's policy as the server's setting makes it."""
    import kernels_cpu
    from benchmarks.engine import make_engine, random_model

    model = random_model("tiny", "bfloat16", quantization="int8")
    assert make_engine(model, "bfloat16", 1, 40, cpu_kernels="off").policy.int8_matmul is None
    on = make_engine(model, "bfloat16", 1, 40, cpu_kernels="on").policy.int8_matmul
    assert (on is not None) == kernels_cpu.available()
    # "auto-sliced": auto, the layers' int8 matrices sliced out of their stacks (the baseline)
    sliced = make_engine(model, "bfloat16", 1, 40, cpu_kernels="auto-sliced").policy.int8_matmul
    auto = make_engine(model, "bfloat16", 1, 40, cpu_kernels="auto").policy.int8_matmul
    assert sliced is None if auto is None else sliced == dataclasses.replace(auto, reads_stacked=False)
    # "auto-strips": auto's policy; its timed runs under the kernel's former [K, N] strip walk
    assert make_engine(model, "bfloat16", 1, 40, cpu_kernels="auto-strips").policy.int8_matmul == auto
    # "auto-xla-rows": auto with XLA's int8 dot above the VNNI rows (the baseline of the AMX tiles)
    xla_rows = make_engine(model, "bfloat16", 1, 40, cpu_kernels="auto-xla-rows").policy.int8_matmul
    assert xla_rows is None if auto is None else xla_rows == dataclasses.replace(auto, amx=False)


def test_engine_benchmark_kernel_env_is_set_only_while_its_engine_runs(monkeypatch):
    from benchmarks.engine import kernel_env

    monkeypatch.delenv("XLASERVE_CPU_KERNELS_KN", raising=False)
    with kernel_env("bfloat16+int8/kernels-auto-strips"):
        assert os.environ["XLASERVE_CPU_KERNELS_KN"] == "strips"
    assert "XLASERVE_CPU_KERNELS_KN" not in os.environ
    with kernel_env("bfloat16+int8/kernels-auto"):
        assert "XLASERVE_CPU_KERNELS_KN" not in os.environ


def test_cpu_kernels_benchmark_runs_one_layer(capsys, monkeypatch):
    import kernels_cpu
    from benchmarks import cpu_kernels

    monkeypatch.delenv("XLASERVE_CPU_KERNELS_KN", raising=False)

    if not kernels_cpu.available():
        pytest.skip("the CPU kernels were not built")
    assert cpu_kernels.main(["--workloads", "layer", "--rows", "1", "--iters", "1", "--variants", "xla", "kernel",
                             "kernel-strips", "kernel-amx", "--copy-mib", "16"]) == 0
    out = capsys.readouterr().out
    assert "copy probe, 2 thread(s)" in out and "| layer | 1 |" in out and "kernel-strips ms" in out
    assert ("kernel-amx ms" in out) == ("amx_int8" in kernels_cpu.isas())
    assert "XLASERVE_CPU_KERNELS_KN" not in os.environ
    assert cpu_kernels.main(["--workloads", "layer", "--rows", "1", "--iters", "1", "--variants", "bf16",
                             "bf16-kernel", "--copy-mib", "16"]) == 0
    out = capsys.readouterr().out
    assert "bf16-kernel ms" in out and "| layer | 1 |" in out and "xla ms" not in out


def test_device_script_imports_no_gateway_dependencies():
    """The device machine has jax, flax (which brings PyYAML) and numpy only: the engine and the
    device benchmark must import and run without fastapi, uvicorn, gguf, sentencepiece,
    platformdirs or llguidance, and without reading configs/ (the server's YAML settings)."""
    blocked = ["fastapi", "uvicorn", "gguf", "sentencepiece", "platformdirs", "llguidance"]
    code = (
        "import sys\n"
        f"for m in {blocked!r}: sys.modules[m] = None  # import raises ImportError\n"
        "import serving.engine.engine, serving.runtime.engine_loop, benchmarks.engine, benchmarks.kernels, benchmarks.device\n"
        "from benchmarks.engine import random_model, make_engine, time_decode\n"
        "m = random_model('tiny', 'bfloat16')\n"
        "print(time_decode(make_engine(m, 'bfloat16', 2, 64), 2, 40, 1, 1) > 0)\n"
        "assert 'serving.config.server_config' not in sys.modules and 'serving.loading.model_registry' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("True")


@pytest.mark.parametrize("argv", [["bench", "engine", "--help"], ["bench", "load", "--help"],
                                  ["bench", "lora", "--help"], ["bench", "cpu-kernels", "--help"]])
def test_xlaserve_bench_hands_arguments_to_the_benchmark(argv, capsys):
    from serving.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert {"engine": "--slots", "load": "--concurrency", "lora": "--adapters",
            "cpu-kernels": "--copy-mib"}[argv[1]] in out


@pytest.mark.slow(90)
def test_batch_interference_runs_on_the_tiny_model(tmp_path):
    """Its three phases run and report (the server's shapes are the tests' tiny server's;
    ``--skip-warmup``: only the shapes the run reaches compile, not the warmup's ~100 programs).

    Slow: a server process, a 16-line batch of 400-token lines and three measured phases of
    streamed requests, on a tiny model whose shapes (decode, prefill and the batch's lines)
    compile in the server on a cold cache (136 s with the warmup, before --skip-warmup)."""
    from benchmarks import batch_interference

    out = batch_interference.main([
        "--model", "tiny-random", "--max-model-len", "512", "--max-slots", "4", "--num-pages", "256",
        "--batch-concurrency", "4", "--lines", "16", "--line-max-tokens", "400", "--requests", "2",
        "--max-tokens", "4", "--skip-warmup", "--json", str(tmp_path / "out.json")])
    assert list(out["phases"]) == ["idle", "batch", "interactive load"]
    assert all(len(p["ttft_s"]) == 2 and p["ttft_p50_s"] > 0 for p in out["phases"].values())
    assert json.loads((tmp_path / "out.json").read_text())["args"]["lines"] == 16


def test_host_kv_tier_benchmark_runs_on_the_tiny_model(tmp_path):
    """Recompute and host-hit TTFT of one repeat; the replay reloads every full prompt page."""
    from benchmarks import host_kv_tier

    out = host_kv_tier.main(["--model", "tiny-random", "--prompt-tokens", "100", "--page-size", "8",
                             "--prefill-chunk", "32", "--max-tokens", "2", "--repeats", "1",
                             "--json", str(tmp_path / "out.json")])
    (row,) = out["repeats"]
    assert row["host_cached_tokens"] == row["cached_tokens"] == 96 and row["host_hit_pages"] == 12
    assert out["identical_output"] and out["ratio"] > 0
    assert json.loads((tmp_path / "out.json").read_text())["args"]["prompt_tokens"] == 100


def test_service_tiers_benchmark_runs_on_the_tiny_model(tmp_path):
    """Its phases run and report: priority TTFT idle and under load, flex shed with their
    ledger rows unbilled, the batch's time against its bound (the tests' tiny server's shapes;
    ``--skip-warmup``: only the shapes the run reaches compile, not the warmup's ~100 programs,
    which took ~96 s on a cold cache)."""
    from benchmarks import service_tiers

    out = service_tiers.main([
        "--model", "tiny-random", "--max-model-len", "512", "--max-slots", "4", "--num-pages", "256",
        "--requests", "2", "--max-tokens", "4", "--load-max-tokens", "24", "--flex-requests", "2",
        "--lines", "2", "--line-max-tokens", "4", "--starvation-seconds", "2", "--skip-warmup",
        "--json", str(tmp_path / "out.json")])
    assert list(out["ttft"]) == ["idle", "priority", "default"]
    assert all(len(p["ttft_s"]) == 2 and p["p50_s"] > 0 for p in out["ttft"].values())
    flex = out["flex"]
    assert flex["status_429"] + flex["status_200"] == 2
    assert flex["shed_rows"] == {"rows": flex["status_429"], "cost_usd": 0.0, "tokens": 0}
    assert out["batch"]["seconds"] > 0 and out["batch"]["bound_s"] > 2
    assert json.loads((tmp_path / "out.json").read_text())["args"]["lines"] == 2


def test_real_size_benchmark_runs_on_the_tiny_shape(tmp_path, monkeypatch):
    """It writes the checkpoint (Llama 3's vocabulary on two tiny layers) under the data dir,
    loads it in a child process as ``generate`` does, reports its numbers and removes it."""
    from benchmarks import real_size
    from serving.config.server_config import data_dir

    written = []
    real_write = real_size.write_checkpoint

    def recording_write(directory, *args, **kw):
        written.append(directory)
        return real_write(directory, *args, **kw)

    monkeypatch.setattr(real_size, "write_checkpoint", recording_write)
    out = real_size.main(["--shape", "tiny", "--decode-tokens", "2", "--max-model-len", "64",
                          "--json", str(tmp_path / "out.json")])
    (directory,) = written
    assert directory.parent == data_dir() and not directory.exists()  # written there, then removed
    assert out["weights_bytes"] == real_size.checkpoint_bytes(real_size.SHAPES["tiny"])
    assert out["load_s"] > 0 and out["ttft_cold_s"] > 0 and out["ttft_s"] > 0
    assert len(out["decode_token_s"]) == 2 and out["prompt_tokens"] > 2
    assert out["rss_before_load"] > 0 and out["peak_rss_after_load"] >= out["rss_after_load"]
    assert out["peak_rss_end"] >= out["peak_rss_after_load"]
    assert json.loads((tmp_path / "out.json").read_text())["args"]["shape"] == "tiny"


def test_lora_benchmark_writes_adapters_the_server_reads(tmp_path):
    """benchmarks/lora.py's random adapters are PEFT folders that ``model.lora_adapter`` serves."""
    from benchmarks.lora import write_random_adapter
    from model.hf_config import read_hf_config
    from model.lora_adapter import TARGETS, read_peft_adapter
    from tests.support.paths import TEST_DATA

    cfg = read_hf_config(TEST_DATA / "hf_tiny" / "gemma3_text")
    write_random_adapter(tmp_path / "a", cfg, rank=4, seed=0)
    adapter = read_peft_adapter(tmp_path / "a", cfg, max_rank=4)
    assert adapter.rank == 4 and set(adapter.weights) == set(TARGETS.values()) and adapter.scaling == 2.0


def test_console_benchmark_runs_on_the_tiny_model(tmp_path):
    """Both sides of the console benchmark run over a filled ledger and report TTFT percentiles
    and the overview polls' latency (the tests' tiny server's shapes, ``--skip-warmup``)."""
    from benchmarks import console

    out = console.main([
        "--serve-args", "--max-model-len 512 --max-slots 4 --num-pages 256 --skip-warmup",
        "--streams", "2", "--seconds", "1", "--rounds", "1", "--max-tokens", "4", "--rows-per-minute", "50",
        "--minutes", "2", "--json", str(tmp_path / "out.json")])
    assert out["without"]["requests"] > 0 and out["with"]["requests"] > 0
    assert 0 < out["without"]["ttft_p50_s"] <= out["without"]["ttft_p99_s"]
    assert out["polls"]["count"] >= 1 and out["polls"]["p50_s"] > 0
    assert json.loads((tmp_path / "out.json").read_text())["args"]["rows_per_minute"] == 50
