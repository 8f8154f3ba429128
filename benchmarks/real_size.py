"""A real-size Llama checkpoint loaded as ``serve`` / ``generate`` load it: load time, peak host
memory, first-token time on this machine.

    python -m benchmarks.real_size                        # Llama 3.1 8B shapes, bfloat16 (~16 GB)
    python -m benchmarks.real_size --shape llama-3.2-1b   # Llama 3.2 1B shapes (~2.5 GB)

At its start it writes a Hugging Face checkpoint with random weights (``config.json`` of a
``LlamaForCausalLM`` with the shapes of ``--shape``, bfloat16 ``*.safetensors`` shards and
their index, Llama 3's tokenizer from the ``llama-models`` package) into a temporary directory
under the data dir (``$XLASERVE_DATA_DIR``), and removes it at the end unless ``--keep``. The
values come from a pool of 16M normal draws at a random offset per tensor: the bytes and shapes
are real, the values do not matter to what is measured.

Then a child process (so that writing does not count; on the CPU unless ``JAX_PLATFORMS`` says
otherwise) starts the engine as ``xlaserve generate``
does (``serving.cli.bootstrap.build_engine``: ``model/safetensors_loader.py`` reading
each tensor into its placement, no warm-up) and reports:

- load time: ``build_engine`` without warm-up (reading and placing the weights, the engine and
  its small KV cache);
- peak host memory: the process's high-water RSS (``VmHWM``) after loading and at the end,
  its RSS before loading, and (peak - before) as a multiple of the checkpoint's bytes (on a
  CPU the placed weights are host memory, so 1.0x is the floor; two copies would be 2x);
- first-token time of a short prompt (``--prompt``): the first request's (it compiles the
  prefill and decode steps) and a second, warm request's, with its next ``--decode-tokens``
  tokens' times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
    "vocab_size": 128256, "torch_dtype": "bfloat16",
}


def _rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SHAPES: dict[str, dict] = {
    # config.json of meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "tie_word_embeddings": False, "rope_scaling": _rope(8.0)},
    # config.json of meta-llama/Llama-3.2-3B
    "llama-3.2-3b": {**_LLAMA, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                     "tie_word_embeddings": True, "rope_scaling": _rope(32.0)},
    # config.json of meta-llama/Llama-3.2-1B
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "tie_word_embeddings": True, "rope_scaling": _rope(32.0)},
    # Llama 3's vocabulary on two tiny layers: the benchmark's own test
    "tiny": {**_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "tie_word_embeddings": False, "rope_scaling": _rope(8.0)},
}

SHARD_BYTES = 1 << 30
"""Bytes per ``*.safetensors`` file written (the writer holds one file's tensors)."""
POOL_VALUES = 1 << 24


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of a ``LlamaForCausalLM`` ``config.json``, in file order."""
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H = config.get("head_dim") or D // config["num_attention_heads"]
    N, K = config["num_attention_heads"], config["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (V, D)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        })
    out["model.norm.weight"] = (D,)
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, D)
    return out


def checkpoint_bytes(config: dict) -> int:
    """Bytes of the bfloat16 tensors :func:`write_checkpoint` writes for ``config``."""
    return sum(math.prod(s) for s in tensor_shapes(config).values()) * 2


def write_checkpoint(directory: Path, config: dict, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, tokenizer: bool = True) -> Path:
    """A ``LlamaForCausalLM`` checkpoint with random bfloat16 weights in ``directory``:
    ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` shards of about ``shard_bytes``,
    ``model.safetensors.index.json`` and (with ``tokenizer``) Llama 3's tokenizer files
    (``config["vocab_size"]`` must then be 128256). Returns ``directory``."""
    import ml_dtypes
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer:
        from tests.support.hf_dir_fixtures import write_llama3_tokenizer

        write_llama3_tokenizer(directory)
    rng = np.random.default_rng(seed)
    pool = (0.02 * rng.standard_normal(POOL_VALUES, np.float32)).astype(ml_dtypes.bfloat16)

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(shape, ml_dtypes.bfloat16)
        n, out = math.prod(shape), np.empty(math.prod(shape), ml_dtypes.bfloat16)
        rolled = np.roll(pool, -int(rng.integers(POOL_VALUES)))  # the pool from a random offset
        for k in range(0, n, POOL_VALUES):
            out[k:k + POOL_VALUES] = rolled[:min(POOL_VALUES, n - k)]
        return out.reshape(shape)

    shapes = tensor_shapes(config)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensor(n, shapes[n]) for n in names}, str(directory / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": checkpoint_bytes(config)}, "weight_map": weight_map}, indent=1))
    return directory


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``: anonymous and file-mapped pages)."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """This process's high-water RSS (``VmHWM``) since it started or since
    :func:`reset_peak_rss`. Not ``ru_maxrss``: that also holds the high-water mark of the
    process that forked this one before its ``exec``."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Resets ``VmHWM`` to the RSS now (``/proc/self/clear_refs`` "5", Linux 4.0+); False
    where the kernel refuses (the peak then counts from the process's start)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(directory: Path, prompt: str, decode_tokens: int, max_model_len: int) -> dict:
    """In this process: start the engine on ``directory`` as ``xlaserve generate`` does, then
    time two greedy requests. Returns the report's numbers (seconds, bytes)."""
    import jax

    from benchmarks.common import timed_request
    from serving.cli.bootstrap import build_engine
    from serving.config.server_config import load_server_config

    jax.block_until_ready(jax.device_put(np.ones(4, np.float32)))  # the backend, up before counting
    reset_peak_rss()
    before = rss_bytes()
    cfg = load_server_config(None, model=str(directory), dtype="bfloat16", max_slots=1,
                             max_model_len=max_model_len, num_pages=max_model_len // 16 + 2,
                             prefill_chunk=64, enable_prefix_caching=False)  # the warm request recomputes
    t0 = time.perf_counter()
    loop, tokenizer, _ = build_engine(cfg, warmup=False)
    jax.block_until_ready(jax.tree.leaves(loop.engine.params))  # dispatched conversions done
    load_s = time.perf_counter() - t0
    rss_loaded = rss_bytes()
    peak_load = peak_rss_bytes()  # read after the RSS: VmHWM >= VmRSS
    ids = tokenizer.encode(prompt, add_bos=True)

    async def requests():
        cold = await timed_request(loop, "cold", ids, 1 + decode_tokens)
        warm = await timed_request(loop, "warm", ids, 1 + decode_tokens)
        return cold, warm

    try:
        (cold_ttft, _, _), (warm_ttft, times, _) = asyncio.run(requests())
    finally:
        loop.stop()
    gaps = [b - a for a, b in zip(times, times[1:])]
    compile_s = {str(k): v for k, v in loop.engine.compile_times.items()}
    return dict(load_s=load_s, compile_s=compile_s, rss_before_load=before, rss_after_load=rss_loaded,
                peak_rss_after_load=peak_load, peak_rss_end=peak_rss_bytes(), prompt_tokens=len(ids),
                ttft_cold_s=cold_ttft, ttft_s=warm_ttft, decode_token_s=gaps,
                decode_token_mean_s=sum(gaps) / len(gaps) if gaps else None)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(shape: str, weights: int, r: dict, write_s: float) -> str:
    extra = (r["peak_rss_after_load"] - r["rss_before_load"]) / weights
    lines = [
        f"{shape}: {_gib(weights)} of bfloat16 weights (written in {write_s:.1f} s)",
        f"load time          {r['load_s']:8.1f} s   (build_engine, no warm-up)",
        f"peak host memory   {_gib(r['peak_rss_after_load'])} after loading = "
        f"{r['peak_rss_after_load'] / weights:.2f}x the weights; before loading "
        f"{_gib(r['rss_before_load'])}, so loading added {extra:.2f}x the weights",
        f"                   {_gib(r['peak_rss_end'])} at the end (after compiling and running)",
        f"first token        {r['ttft_cold_s']:8.2f} s   cold (compiles prefill; "
        f"{sum(r['compile_s'].values()):.1f} s compiling in all, or loading compiled programs "
        f"from the cache); {r['ttft_s']:.2f} s warm ({r['prompt_tokens']}-token prompt)",
    ]
    if r["decode_token_s"]:
        lines.append(f"decode             {r['decode_token_mean_s']:8.3f} s per token  ("
                     + ", ".join(f"{g:.3f}" for g in r["decode_token_s"]) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--decode-tokens", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it "
                    "(reused if its config.json is this shape's)")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.measure:
        r = measure(Path(args.measure), args.prompt, args.decode_tokens, args.max_model_len)
        print("RESULT " + json.dumps(r))
        return r

    from serving.config.server_config import data_dir

    config = SHAPES[args.shape]
    weights = checkpoint_bytes(config)
    if args.keep:
        directory = Path(args.keep)
    else:
        data_dir().mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=f"real-size-{args.shape}-", dir=data_dir()))
    try:
        t0 = time.perf_counter()
        cfg_file = directory / "config.json"
        if not (cfg_file.is_file() and json.loads(cfg_file.read_text()) == config
                and (directory / "model.safetensors.index.json").is_file()):
            write_checkpoint(directory, config)
        write_s = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "benchmarks.real_size", "--measure", str(directory),
               "--prompt", args.prompt, "--decode-tokens", str(args.decode_tokens),
               "--max-model-len", str(args.max_model_len)]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        res = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                             text=True, env=env)
        result = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        if res.returncode != 0 or not result:
            raise RuntimeError(f"the measuring process failed ({res.returncode}):\n{res.stderr[-3000:]}")
        r = json.loads(result[-1][len("RESULT "):])
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    out = dict(shape=args.shape, weights_bytes=weights, write_s=write_s, **r,
               peak_over_weights=r["peak_rss_after_load"] / weights,
               load_added_over_weights=(r["peak_rss_after_load"] - r["rss_before_load"]) / weights)
    print(report(args.shape, weights, r, write_s))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), **out), indent=1))
    return out


if __name__ == "__main__":
    main()
