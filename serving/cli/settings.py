"""The model and engine flags ``serve``, ``engine`` and ``generate`` share, as overrides of the
server settings (``configs/server.yaml``, ``serving.config.server_config``)."""

from __future__ import annotations

import argparse

_SETTINGS = [
    # (flag, type, help)
    ("model", str, "model name from configs/models.yaml, a .gguf file, a Hugging Face checkpoint "
                   "directory, or a Hugging Face Hub id (org/name)"),
    ("revision", str, "branch, tag or commit of a Hub id --model (default: main)"),
    ("dtype", str, "float32 | bfloat16: weights and matmul inputs"),
    ("kv_dtype", str, "KV cache dtype (default: same as --dtype)"),
    ("max_model_len", int, "context window in tokens (prompt + completion)"),
    ("max_slots", int, "concurrently decoding sequences"),
    ("page_size", int, "tokens per KV-cache page"),
    ("num_pages", int, "KV-cache pool size in pages"),
    ("kv_cache_dtype", str, "auto | bfloat16 | int8 | fp8: the KV pages' format; int8 and fp8 (e4m3) store "
                            "1-byte values and a float32 scale per token and KV head (auto: --kv-dtype's pages)"),
    ("kv_cache_bytes", int, "KV-cache pool size in bytes (K, V and scale pages of every layer), instead of "
                            "--num-pages: int8 / fp8 pages fit ~2x the tokens of bfloat16 ones"),
    ("host_kv_cache_gib", float, "host-memory KV tier under the prefix cache, in GiB: evicted and "
                                 "preempted pages are kept there and reloaded on a prefix hit (0: off)"),
    ("kv_disk_dir", str, "disk KV tier under the host tier: pages the host tier evicts, and every cached "
                         "page at shutdown, are kept in files here (keyed by prefix hash, model and KV "
                         "format) and read back on a prefix hit, also after a restart (needs "
                         "--host-kv-cache-gib and --kv-disk-max-bytes)"),
    ("kv_disk_max_bytes", int, "the disk KV tier's bound in bytes (least recently used files removed past it)"),
    ("prefill_chunk", int, "most prompt tokens per prefill step (power of two)"),
    ("max_prefill_seqs", int, "sequences packed into one prefill step"),
    ("min_decode_batch", int, "smallest decode batch bucket"),
    ("max_waiting", int, "waiting requests before new ones get 503"),
    ("max_waiting_tokens", int, "waiting prompt tokens before new ones get 503"),
    ("token_budget", int, "most tokens computed per step (decode rows + prompt chunks)"),
    ("attention_impl", str, "auto | xla | pallas"),
    ("drain_timeout", float, "seconds open streams get to finish after SIGTERM"),
    ("mesh", str, "device mesh, e.g. data=1,tensor=4,expert=1 (default: one device)"),
    ("checkpoint", str, "orbax checkpoint directory (from xlaserve convert) instead of --model"),
    ("chat_template", str, "Jinja chat template FILE (or JSON with a chat_template field) served "
                           "instead of the model's own"),
    ("quantization", str, "none | int8 | auto: int8 weights (layer matrices and output head) with float "
                          "scales, GGUF Q8_0 blocks exactly; auto: int8 for steps of few rows where this "
                          "CPU runs them faster, the served dtype above (no batch invariance); unset: int8 for "
                          "a bf16 model from a quantized GGUF where the CPU kernel serves the int8 dots, else none"),
    ("cpu_kernels", str, "auto | on | off: the int8 dots' integer products on the CPU by xlaserve's own "
                         "kernels (kernels_cpu) instead of XLA's dot; auto: where they measured faster on "
                         "this CPU (same results every way)"),
    ("speculative", str, "speculative decoding method: ngram (drafts from the request's own n-grams) | "
                         "draft (drafts from --draft-model) | eagle3 (an EAGLE-3 head, --draft-model DIR)"),
    ("draft_model", str, "with --speculative draft: self:int8 (the served model's int8 copy), or a draft "
                         "model as --model takes it (directory, GGUF, Hub id) with the same tokenizer; "
                         "with eagle3: the EAGLE-3 head's directory (config.json + safetensors)"),
    ("draft_vocab", int, "with --draft-model self:int8: the draft's head computes logits over N of the served "
                         "vocabulary's ids (Gemma 3: the most frequent, configs/draft_vocab.yaml; else the first "
                         "N) and proposes among them (default 32768, or the whole vocabulary when smaller; "
                         "N = the vocabulary size: the full head)"),
    ("num_speculative_tokens", int, "K: draft tokens verified per step (1..15; with --speculative)"),
    ("prompt_lookup_min", int, "shortest n-gram looked up for drafts (default 2)"),
    ("prompt_lookup_max", int, "longest n-gram looked up for drafts, tried first (default 4)"),
    ("speculative_max_batch", int, "speculate only while at most this many requests run (default 2)"),
    ("speculative_token_budget", int, "tokens a verify step may compute: with R requests running each gets "
                                      "min(K, budget // R - 1) drafts, K shrinking as the batch grows "
                                      "(default (K + 1) x --speculative-max-batch: K throughout)"),
    ("flex_starvation_preemptions", int, "a flex request or batch line preempted more than this many "
                                         "times runs as default work from then on (default 3)"),
    ("lora_modules", "NAME=PATH", "LoRA adapters served beside the model: PEFT folders "
                                  "(adapter_config.json + adapter_model.safetensors), each picked by "
                                  "naming it as the request's model"),
    ("max_loras", int, "LoRA adapters resident on the device at once (default: as many as "
                       "--lora-modules names, at most 4; 0: no LoRA)"),
    ("max_lora_rank", int, "the largest LoRA rank served (default 16)"),
    ("max_cpu_loras", int, "read LoRA adapters kept in host memory (default: --max-loras)"),
    ("flex_starvation_seconds", float, "a flex request or batch line waiting longer than this many seconds "
                                       "runs as default work from then on (default 60)"),
]


def _add_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="server YAML (default: configs/server.yaml)")
    for name, typ, help_ in _SETTINGS:
        if typ == "NAME=PATH":  # a list: --lora-modules a=/path/a b=/path/b
            p.add_argument("--" + name.replace("_", "-"), dest=name, nargs="+", metavar=typ, default=None,
                           help=help_)
            continue
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)


def _overrides(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    names = [n for n, _, _ in _SETTINGS] + list(extra)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
