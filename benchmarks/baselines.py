"""Baselines for the engine benchmark: llama.cpp and Hugging Face transformers on the same GGUF.

Optional: neither is an install dependency of xlaserve. Install them into the
same environment (exact commands in benchmarks/RESULTS.md)::

    pip install torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl   # torch's CPU build first
    pip install -e '.[baselines]'   # llama-cpp-python[server] (compiles, ~10 min), transformers, accelerate

Each runner takes prompts as token ids (``[N][prompt_len]``, the same ids our
engine gets, so tokenizers cannot differ) and decodes ``new_tokens`` greedy
tokens for all N sequences at once, returning a dict with

* ``decode_tokens_per_s``: tokens after each sequence's first, over the time
  after the first token (aggregate over the N sequences);
* ``e2e_tokens_per_s``: all generated tokens over the whole time, prefill included;
* ``ttft_s``: time to the first token of every sequence (the batched prefill).

llama.cpp runs its own batched decode through the low-level API
(``llama_batch`` / ``llama_decode``: one batch holds one token of each of the N
sequences, each with its own ``seq_id``, over a unified KV cache), argmax on
its logits, no HTTP and no Python sampler. transformers runs
``model.generate`` on the ``[N, prompt_len]`` batch in float32 (the GGUF is
dequantized on load, as in the golden reference), on ``threads`` torch threads.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import time
from pathlib import Path

import numpy as np


def model_gguf_path(name: str) -> Path:
    """The GGUF file behind a configs/models.yaml name (or a .gguf path itself)."""
    if name.endswith(".gguf"):
        return Path(name)
    from serving.loading.model_registry import known_models

    spec = known_models()[name]
    if spec["source"] != "gguf-package":
        raise ValueError(f"model {name!r} has no GGUF file (source {spec['source']!r})")
    return Path(importlib.import_module(spec["package"]).assemble())


def make_runner(name: str, gguf: Path, max_seqs: int, max_len: int, threads: int | None):
    """A callable ``(prompts, new_tokens) -> dict`` for baseline ``name`` ("llama.cpp" | "transformers")."""
    threads = threads or os.cpu_count()
    if name == "llama.cpp":
        return LlamaCppBatched(gguf, max_seqs, max_len, threads)
    if name == "transformers":
        return TransformersGenerate(gguf, threads)
    raise ValueError(f"unknown baseline {name!r}")


def deny_amx_permission() -> None:
    """Makes this process's request for AMX tile state fail (Linux x86-64), for good.

    llama.cpp built for a CPU with AMX asks the kernel for the tile state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) and, when granted, runs its AMX
    matmuls; on a machine that advertises AMX but cannot run it (some VMs) the
    first ``llama_decode`` dies of SIGILL. With this seccomp filter installed
    first, that request gets EPERM, and llama.cpp keeps every other kernel
    (its repacked AVX-512 ones included). Call it only in a child process:
    the filter cannot be removed.

    Raises:
      OSError: the kernel refused the filter (no seccomp, or not x86-64).
    """
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    arch_prctl, req_xcomp_perm, audit_arch_x86_64 = 158, 0x1023, 0xC000003E
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    program = [
        (ld, 0, 0, 4), (jeq, 0, 5, audit_arch_x86_64),  # seccomp_data.arch; other arch: allow
        (ld, 0, 0, 0), (jeq, 0, 3, arch_prctl),  # .nr
        (ld, 0, 0, 16), (jeq, 0, 1, req_xcomp_perm),  # .args[0], low 32 bits
        (ret, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        (ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    ]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(code))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if (libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0
            or libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) != 0):
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)}")


class LlamaCppBatched:
    """llama.cpp's batched decode of N sequences through llama-cpp-python's low-level API."""

    def __init__(self, gguf: Path, max_seqs: int, max_len: int, threads: int, n_batch: int = 512):
        import llama_cpp as lc

        self.lc = lc
        # Keep llama.cpp's load-time log off the report (errors still raise below).
        self._quiet = lc.llama_log_callback(lambda level, text, user_data: None)
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_seqs * max_len
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = max_seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, max_seqs)
        self.version = f"llama-cpp-python {lc.__version__}, {threads} threads"

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits); one llama_decode call."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, n_out: int) -> list[int]:
        ptr = self.lc.llama_get_logits(self.ctx)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                    shape=(n_out, self.n_vocab))
        return arr.argmax(axis=-1).tolist()

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> dict:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        # Prefill: all prompts' tokens, n_batch at a time, logits at each prompt's last token.
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = []
        for i in range(0, len(items), self.n_batch):
            chunk = items[i:i + self.n_batch]
            self._decode(chunk)
            n_out = sum(1 for it in chunk if it[3])
            if n_out:
                last += self._argmax(n_out)
        t_first = time.perf_counter()
        pos = [len(p) for p in prompts]
        for _ in range(new_tokens - 1):
            self._decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = self._argmax(len(prompts))
            pos = [x + 1 for x in pos]
        end = time.perf_counter()
        n = len(prompts)
        return dict(decode_tokens_per_s=n * (new_tokens - 1) / (end - t_first),
                    e2e_tokens_per_s=n * new_tokens / (end - t0), ttft_s=t_first - t0)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class TransformersGenerate:
    """transformers' ``generate`` on a batch, float32 weights dequantized from the GGUF."""

    def __init__(self, gguf: Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        self.model.eval()
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}, {threads} threads"

    def _generate(self, ids, n: int) -> float:
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> dict:
        ids = self.torch.tensor(prompts, dtype=self.torch.long)
        ttft = self._generate(ids, 1)  # the prefill (and one token) alone
        total = self._generate(ids, new_tokens)
        n = len(prompts)
        return dict(decode_tokens_per_s=n * (new_tokens - 1) / max(total - ttft, 1e-9),
                    e2e_tokens_per_s=n * new_tokens / total, ttft_s=ttft)
