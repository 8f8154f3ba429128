"""Where a decode step's time goes: its attention and its output head, each timed alone at the step's shapes.

The roofline line says what fraction of the machine's limit a step reaches;
this says where the rest of the time goes. Two programs run on the engine's own
arrays and choices, at the step's own shapes:

* attention: the paged attention of every layer, as the model runs it (a scan
  over the layers reading the engine's KV cache through the step's page table
  and lengths, each layer's sliding window, the backend policy's attention
  implementation); each layer's output is the next layer's query, so nothing is
  hoisted out of the scan.
* output head: the ``[rows, hidden] x [hidden, vocab]`` dot of the tied
  embedding through the policy's dot (``Compute.dot``; an int8 head as the
  policy computes it), with the final soft cap.

The rest of the step (the layers' projections and MLP, norms, RoPE, the KV
writes, sampling, dispatch) is the step time minus the two. Parts measured
alone do not overlap with the others as in the fused step, so the rest can come
out slightly negative when the two are most of the step: it is printed as is.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

PARTS = ("attention", "head", "rest")


@dataclasses.dataclass(frozen=True)
class StepParts:
    """Seconds of one decode step and of its parts (``rest`` = step - attention - head)."""

    step: float
    attention: float
    head: float

    @property
    def rest(self) -> float:
        return self.step - self.attention - self.head

    def line(self) -> str:
        """'attention a ms (x%), output head h ms (y%), rest r ms (z%: ...)' of the step time."""
        def part(name, s):
            return f"{name} {s * 1e3:.1f} ms ({s / self.step:.0%})"
        return (f"where it goes: {part('attention', self.attention)}, {part('output head', self.head)}, "
                f"{part('rest', self.rest)}: projections, MLP, norms, KV writes, sampling")

    def as_dict(self) -> dict:
        return dict(step_s=self.step, attention_s=self.attention, head_s=self.head, rest_s=self.rest)


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_parts(engine, model, rows, step_seconds: float, repeats: int = 3) -> StepParts:
    """Times the attention and the output head of the decode step of ``rows`` alone.

    Args:
      engine: the ``serving.engine.engine.Engine`` whose step was timed (its KV cache,
        sizes and backend policy are used).
      model: the model the engine serves (its config, dtype and head weight).
      rows: the step's ``serving.core.sched.step_plan.DecodeRow`` list.
      step_seconds: the measured time of the whole step.
      repeats: timed runs of each part (median).
    """
    from kernels_pallas.attention import paged_attention
    from model.layers import weight
    from model.quantization import QuantizedArray, requantize_per_channel
    from serving.engine.step_batch import DecodeBatch

    cfg = model.cfg
    compute = engine.policy.compute(dtype=model.dtype)
    batch = DecodeBatch.from_rows(rows, engine.cfg)
    B = batch.slot_ids.shape[0]
    kv = engine.kv_cache
    page_size = engine.cfg.page_size
    use_window = cfg.has_sliding_layers
    windows = jnp.asarray(cfg.layer_windows(), jnp.int32)
    q_dtype = jnp.dtype(engine.cfg.kv_dtype)
    q = jax.random.normal(jax.random.key(0), (B, cfg.num_heads, cfg.head_dim), jnp.float32).astype(q_dtype)

    @jax.jit
    def attention(q, k_cache, v_cache, batch):
        md = batch.attention_metadata(page_size)

        def layer(q, xs):
            index, window = xs
            out = paged_attention(
                q, k_cache, v_cache, md, layer=index, scale=cfg.attn_scale,
                sliding_window=window if use_window else None, soft_cap=cfg.attn_logit_softcap,
                config=compute.attention, window_bound=cfg.sliding_window if use_window else None)
            return out, None

        return jax.lax.scan(layer, q, (jnp.arange(cfg.num_layers, dtype=jnp.int32), windows))[0]

    embed = weight(model, "embed")
    if isinstance(embed, QuantizedArray) and compute.quantized_dot != "dequantize":
        embed = requantize_per_channel(embed)  # a GGUF's Q8_0 head, as the engine stores it
    x = jax.random.normal(jax.random.key(1), (B, cfg.hidden_size), jnp.float32)

    @jax.jit
    def head(x, embed):
        logits = compute.dot("sd,vd->sv", x, embed, model.dtype)
        if cfg.final_logit_softcap is not None:
            c = cfg.final_logit_softcap
            logits = c * jnp.tanh(logits / c)
        return logits

    return StepParts(step_seconds, _median_seconds(attention, (q, kv.k, kv.v, batch), repeats),
                     _median_seconds(head, (x, embed), repeats))
