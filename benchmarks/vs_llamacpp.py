"""Head to head through HTTP: ``xlaserve serve`` variants against llama.cpp (its server, its batched decode).

    python -m benchmarks.vs_llamacpp                      # base server, 32 and 1 streams
    python -m benchmarks.vs_llamacpp --anchor both --threads 2   # llama-server and llama-cpp-python
    python -m benchmarks.vs_llamacpp --closed-loop --streams 32 1   # 2N+ requests, 20-400 token prompts
    python -m benchmarks.vs_llamacpp --variant base="" --variant int8="--quantization int8" \\
        --variant spec="--speculative ngram --num-speculative-tokens 4"
    git worktree add ../before HEAD~3                     # a baseline commit beside this tree
    python -m benchmarks.vs_llamacpp --variant before@../before= --variant after=
    xlaserve bench vs-llamacpp ...                        # the same

For each ``--variant NAME="FLAGS"`` in turn, starts ``python -m serving.cli.main
serve FLAGS`` (from ``--server-dir``, or from DIR for ``NAME@DIR="FLAGS"``: another
checkout, to measure a baseline commit in the same command; the server's defaults plus
FLAGS, any ``xlaserve serve`` flags,
on a free loopback port, its ledger in a temporary SQLite file), waits for
``/health``, streams greedy completions (``temperature`` 0, ``ignore_eos``,
``--output-len`` tokens each) with ``benchmarks.load``'s client for each
``--streams`` count N (a closed loop of N requests in flight,
``max(N, --min-requests)`` requests), then stops it.

``--anchor`` picks what llama.cpp runs. ``llama-server`` (the default where
the binary is cached or cmake and a C++ compiler are on PATH; built on first
use, minutes, before our servers start, by ``benchmarks.llama_server``;
``--llama-server-binary`` names another): llama.cpp's own HTTP server with
continuous batching, ``-np`` the largest stream count, ``--threads`` threads,
the same GGUF, gets the same load (runs, prompts) after our servers have
stopped (``benchmarks.vs_llama_server``); in this mode both sides get the
prompts as the same token ids and one connection per request (llama-server
closes each one after a streamed response), and a table of both sides'
tokens/s, TTFT and ITL p50/p99 with the ratios xlaserve / llama-server comes
first. ``llama-cpp-python`` (the default elsewhere; ``both`` runs both): with no server
running, llama.cpp (llama-cpp-python, ``--threads`` threads, in a child
process) decodes the same prompts' token ids through ``llama_batch`` /
``llama_decode``, N sequences per batch (``benchmarks.baselines.LlamaCppBatched``,
as ``benchmarks.engine --baselines llama.cpp`` runs it; greedy argmax, no
HTTP), from the same GGUF, each stream count's prompts in batches of N. One
thing runs at a time. A llama.cpp build that dies of SIGILL (AMX code on a
machine that advertises AMX but cannot run it) is rerun with AMX denied to it
by a seccomp filter, its other kernels unchanged (the line naming its version
says so).

Prompts: ``benchmarks/prose_prompts.jsonl``, 40 plain English sentences
written for this benchmark (20 to 25 Gemma 3 tokens each with the BOS; no
other source), or ``--prompts-file`` (one ``{"prompt": ...}`` per line). The
token ids are those the first server's ``POST /tokenize`` gives (its BOS
first), so both sides decode the same ids; each later server's ids are
checked against them. The last prompt is the warm-up request (16 tokens, not
counted); each stream count takes the next prompts in file order, so no
measured prompt repeats an earlier one (the prefix cache holds nothing they
can reuse) unless the file runs out (40 prompts: one round of 32 and 1
streams; a note says when they repeat).

``--closed-loop`` (``benchmarks.closed_loop``): each run sends ``max(2N,
--min-requests)`` requests through its N streams, so requests keep arriving
while others decode, with prompts of mixed length (``--prompt-tokens``, 20 to
400 tokens by default) built from the prompts file's sentences, none sharing a
prefix; after the tables it prints each variant's step profile per stream
count (the median run's engine-loop turns, read off ``/metrics``: per-turn
milliseconds of planning, prefill and decode dispatch, readback wait and
per-token host work; turns that mixed prefill and decode rows; prefill tokens
and decode rows per turn). llama.cpp decodes the same prompts in batches of N.

``--rounds R`` runs each stream count R times on each server and on
llama.cpp; the table shows, per side, the run with the median tokens/s
(output tokens/s for ours, decode tokens/s for llama.cpp).

Columns (tokens/s aggregate over the streams; milliseconds for latencies):

* ``out tok/s``: completion tokens over the run's wall time, first request
  sent to last stream ended (``benchmarks.load``'s output throughput: HTTP,
  tokenization, queueing and prefill included);
* ``decode tok/s``: tokens after each stream's first, over the time covered
  by the streams' [first token, end] intervals (their union);
* ``TTFT p50``, ``ITL p50``: ``benchmarks.load``'s nearest-rank percentiles
  (p90 and p99 in the latency table below the main one);
* ``llama.cpp decode`` / ``llama.cpp e2e``: ``LlamaCppBatched``'s decode
  tokens/s (after the batched prefill) and end-to-end tokens/s (prefill
  included), summed over its batches;
* ``out / llama decode``: the headline ratio (our HTTP output tokens/s against
  llama.cpp's decode tokens/s, which leaves out its prefill and has no HTTP:
  the stricter of the two); ``out / llama e2e`` beside it;
* ``same text``: completions whose streamed text equals the first variant's
  for the same prompt (greedy: a variant that should not change outputs,
  such as speculation in float32, shows all).

Also prints the load average at the start and the end, and each server's
``/metrics`` samples whose names mention speculation, drafts or acceptance
(a variant with speculative decoding reports its acceptance rate there).
Read the ratios; absolute numbers move with the machine and its neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from benchmarks.closed_loop import format_profile, mixed_prompts, profile_delta, scrape_profile
from benchmarks.common import cli_module, free_port
from benchmarks.load import RequestResult, _payload, _run_one, send_request, summarize
from benchmarks.vs_tables import (  # noqa: F401  (decode_throughput, interval_union: this module's API too)
    Row, decode_throughput, fmt, format_anchor_table, format_latency_table, format_table, interval_union, median_run)

ROOT = Path(__file__).resolve().parents[1]
PROSE_PROMPTS = Path(__file__).with_name("prose_prompts.jsonl")
METRIC_WORDS = ("spec", "draft", "accept")
ANCHORS = ("llama-server", "llama-cpp-python", "both")


@dataclass(frozen=True)
class Variant:
    """A server configuration: a label, the extra ``xlaserve serve`` flags and, optionally,
    another source tree to serve from (a baseline checkout: ``git worktree add``)."""

    name: str
    flags: tuple[str, ...]
    server_dir: Path | None = None


def parse_variant(text: str) -> Variant:
    """``NAME=FLAGS`` or ``NAME@DIR=FLAGS`` (FLAGS split as a shell would; may be empty;
    DIR: the source tree that variant serves from, e.g. a worktree of the baseline commit) -> Variant.

    Raises:
      argparse.ArgumentTypeError: no ``=``, an empty name, an empty DIR or one that is not a
        directory, or unbalanced quotes in FLAGS.
    """
    head, sep, flags = text.partition("=")
    name, at, where = (part.strip() for part in head.partition("@"))
    if not sep or not name or (at and not where):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=FLAGS or NAME@DIR=FLAGS, "
                                         "e.g. int8='--quantization int8'")
    server_dir = Path(where).resolve() if at else None
    if server_dir is not None and not server_dir.is_dir():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {where} is not a directory")
    try:
        return Variant(name, tuple(shlex.split(flags)), server_dir)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {e}") from None


def load_prompts(path: str | Path) -> list[str]:
    """The prompts of a JSONL file (one ``{"prompt": str}`` per line; blank lines skipped).

    Raises:
      ValueError: a line without a non-empty string ``prompt``, or fewer than 2 prompts.
    """
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        p = json.loads(line).get("prompt")
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"{path}:{i + 1}: no non-empty string 'prompt'")
        out.append(p)
    if len(out) < 2:
        raise ValueError(f"{path}: needs at least 2 prompts (one is the warm-up), has {len(out)}")
    return out


def assign_prompts(num_prompts: int, runs: Sequence[int]) -> tuple[int, list[list[int]], bool]:
    """Prompt indices: (warm-up, one list per run of ``runs[i]`` requests, whether any repeat).

    The last prompt is the warm-up; the runs take the others in order, cycling
    when they run out (then the third value is True).
    """
    pool = num_prompts - 1
    out, k = [], 0
    for n in runs:
        out.append([(k + i) % pool for i in range(n)])
        k += n
    return num_prompts - 1, out, k > pool


def metric_lines(metrics_text: str, words: Sequence[str] = METRIC_WORDS) -> list[str]:
    """Prometheus text-format samples whose metric name contains one of ``words`` (comments dropped)."""
    out = []
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0].lower()
            if any(w in name for w in words):
                out.append(line)
    return out


# --------------------------------------------------------------------------- our server


class Server:
    """``xlaserve serve FLAGS`` (``python -m``) on a free loopback port, from ``server_dir``.

    Raises RuntimeError (with the log's tail) when it exits or is not healthy within timeout_s.
    """

    def __init__(self, flags: Sequence[str], workdir: Path, server_dir: Path = ROOT, timeout_s: float = 900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        args = list(flags)
        if "--database-url" not in args:
            args += ["--database-url", f"sqlite:///{workdir / 'ledger.db'}"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", cli_module(server_dir), "--log-level", "WARNING", "serve", *args,
             "--port", str(self.port)],
            cwd=server_dir, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def _drive(url: str, texts: list[str], warmup: int, runs: list[tuple[int, list[int]]],
                 output_len: int, timeout_s: float, same_ids: bool = False
                 ) -> tuple[str, list[list[int]], list[list[RequestResult]], str, list[dict[str, float]]]:
    """Against one healthy server: (model id, token ids of texts, results per run, /metrics text,
    the step profile of each run: ``closed_loop.profile_delta`` of /metrics around it).
    ``warmup``: the index of the warm-up prompt. ``same_ids``: send the prompts as those token
    ids, one connection per request (as ``vs_llama_server`` sends them to llama-server)."""
    import httpx

    from benchmarks.vs_llama_server import load_config, request_limits

    limits = request_limits(max(n for n, _ in runs), keepalive=not same_ids)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=30.0),
                                 limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        ids = []
        for t in texts:
            r = await client.post("/tokenize", json={"model": model, "prompt": t, "add_special_tokens": True})
            r.raise_for_status()
            ids.append(r.json()["tokens"])
        cfg = load_config(url, model, output_len, timeout_s)  # the bodies llama-server gets too
        prompts = ids if same_ids else texts
        w = await send_request(client, f"{url}/v1/completions", _payload(cfg, prompts[warmup], 16))
        if not w.ok:
            raise RuntimeError(f"warm-up request failed: {w.error}")
        results, profiles = [], []
        metrics = (await client.get("/metrics")).text
        for n, idx in runs:
            before = scrape_profile(metrics)
            results.append(await _run_one(cfg, client, f"{url}/v1/completions", "concurrency", n,
                                          [(prompts[i], output_len) for i in idx]))
            metrics = (await client.get("/metrics")).text
            profiles.append(profile_delta(before, scrape_profile(metrics)))
    return model, ids, results, metrics, profiles


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_run(runner, groups: Sequence[Sequence[Sequence[int]]], new_tokens: int) -> dict[str, float]:
    """Runs ``runner(prompts, new_tokens)`` per group (a batch of sequences); rates over the summed times."""
    dec_tok = dec_s = e2e_tok = e2e_s = 0.0
    ttfts = []
    for g in groups:
        r = runner([list(p) for p in g], new_tokens)
        n = len(g)
        dec_tok += n * (new_tokens - 1)
        dec_s += n * (new_tokens - 1) / r["decode_tokens_per_s"]
        e2e_tok += n * new_tokens
        e2e_s += n * new_tokens / r["e2e_tokens_per_s"]
        ttfts.append(r["ttft_s"])
    return {"decode_tokens_per_s": dec_tok / dec_s, "e2e_tokens_per_s": e2e_tok / e2e_s,
            "ttft_s": sorted(ttfts)[len(ttfts) // 2]}


def _llamacpp_child(conn, gguf: str, runs: list[tuple[int, list[list[int]]]], new_tokens: int, threads: int,
                    deny_amx: bool) -> None:
    """In a spawned process: (version, [llamacpp_run(...) per run]) sent on conn."""
    from benchmarks.baselines import LlamaCppBatched, deny_amx_permission

    if deny_amx:
        deny_amx_permission()

    max_seqs = max(n for n, _ in runs)
    max_len = max(len(p) for _, prompts in runs for p in prompts) + new_tokens
    runner = LlamaCppBatched(Path(gguf), max_seqs, max_len, threads)
    out = []
    try:
        runner(runs[0][1][:1], 4)  # warm-up, not counted
        for n, prompts in runs:
            out.append(llamacpp_run(runner, [prompts[k:k + n] for k in range(0, len(prompts), n)], new_tokens))
    finally:
        runner.close()
    conn.send((runner.version + (", AMX denied" if deny_amx else ""), out))


def run_llamacpp(gguf: Path, runs: list[tuple[int, list[list[int]]]], new_tokens: int, threads: int,
                 timeout_s: float, child=_llamacpp_child) -> tuple[str, list[dict[str, float]]]:
    """llama.cpp on each (streams, prompt ids) run, in a child process: (version, results per run).

    A child killed by SIGILL (a build with AMX code this machine advertises
    but cannot run) is retried with AMX denied to llama.cpp
    (``baselines.deny_amx_permission``: its other kernels stay), and the
    version string says so. ``child`` is the child's function
    (``_llamacpp_child``'s arguments; importable, as the child is spawned).

    Raises:
      RuntimeError: the child failed otherwise, or did not finish within timeout_s.
    """
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    for deny_amx in (False, True):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=child, args=(send, str(gguf), runs, new_tokens, threads, deny_amx))
        p.start()
        send.close()
        try:
            got = recv.recv() if recv.poll(timeout_s) else None
        except EOFError:  # the child died before sending
            got = None
        p.join(60)
        if got is not None and p.exitcode == 0:
            return got
        if p.exitcode is None:
            p.kill()
            p.join()
            raise RuntimeError(f"llama.cpp did not finish in {timeout_s:.0f} s")
        if p.exitcode == -signal.SIGILL and not deny_amx:
            print("   llama.cpp died of SIGILL (an instruction this machine cannot run, e.g. AMX): "
                  "retrying with AMX denied to it", flush=True)
            continue
        raise RuntimeError(f"llama.cpp exited with {p.exitcode}")
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- report


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vs_llamacpp", description=__doc__.splitlines()[0],
                                 epilog="Columns and method: see the module docstring (benchmarks/vs_llamacpp.py).")
    ap.add_argument("--variant", action="append", type=parse_variant, metavar='NAME="FLAGS"',
                    help='a server configuration: a label and extra `xlaserve serve` flags, repeatable '
                         '(default: base="")')
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 1], help="concurrent streams per run (default: 32 1)")
    ap.add_argument("--min-requests", type=int, default=4,
                    help="requests per run: max(streams, this), or max(2 x streams, this) with "
                         "--closed-loop (default: 4)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="2N+ requests per N streams, prompts of mixed length (--prompt-tokens), "
                         "and each run's step profile (benchmarks.closed_loop)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[20, 400], metavar=("MIN", "MAX"),
                    help="with --closed-loop: prompt lengths, about MIN to MAX tokens (default: 20 400)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per stream count on each server and on llama.cpp; the table shows the "
                         "median run (default: 1)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens per completion (default: 128)")
    ap.add_argument("--prompts-file", default=str(PROSE_PROMPTS),
                    help='JSONL, one {"prompt": ...} per line (default: benchmarks/prose_prompts.jsonl)')
    ap.add_argument("--model", default="gemma-3-270m",
                    help="configs/models.yaml name or .gguf path, for the server (--model) and llama.cpp")
    ap.add_argument("--gguf", help="the GGUF llama.cpp loads (default: --model's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all cores)")
    ap.add_argument("--anchor", choices=ANCHORS,
                    help="what llama.cpp runs: its own server through the same HTTP load (llama-server), the "
                         "llama-cpp-python batched decode, or both (default: llama-server where the binary is "
                         "built or cmake and a C++ compiler are on PATH, else llama-cpp-python)")
    ap.add_argument("--llama-server-binary", type=Path, help="a llama-server to run (default: build or reuse "
                    "the cached one, benchmarks.llama_server)")
    ap.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="our variants only")
    ap.add_argument("--server-dir", type=Path, default=ROOT, help="source tree to serve from (default: this one)")
    ap.add_argument("--timeout", type=float, default=900.0, help="server start and per-request timeout, s")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    a.variant = a.variant or [Variant("base", ())]
    names = [v.name for v in a.variant]
    if len(set(names)) != len(names):
        ap.error(f"--variant names must differ: {names}")
    if any(f == "--port" or f.startswith("--port=") for v in a.variant for f in v.flags):
        ap.error("--variant flags may not set --port (each server gets a free one)")
    if any(s < 1 for s in a.streams) or min(a.min_requests, a.rounds) < 1 or a.output_len < 2:
        ap.error("--streams, --min-requests and --rounds must be at least 1, --output-len at least 2")
    if not 1 <= a.prompt_tokens[0] <= a.prompt_tokens[1]:
        ap.error("--prompt-tokens MIN MAX: 1 <= MIN <= MAX")
    if a.anchor is None:
        from benchmarks.llama_server import can_build

        a.anchor = "llama-server" if a.llama_server_binary or can_build() else "llama-cpp-python"
    a.anchors = () if not a.llamacpp else ("llama-server", "llama-cpp-python") if a.anchor == "both" else (a.anchor,)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    texts = load_prompts(a.prompts_file)
    if "llama-server" in a.anchors and a.llama_server_binary is None:  # build before anything runs
        from benchmarks.llama_server import ensure_built

        a.llama_server_binary = ensure_built()
    plan = [n for n in a.streams for _ in range(a.rounds)]  # the runs against each server, in order
    per_run = [max(2 * n if a.closed_loop else n, a.min_requests) for n in plan]
    source = a.prompts_file
    if a.closed_loop:
        texts = mixed_prompts(texts, sum(per_run) + 1, *a.prompt_tokens)
        source = f"{a.prompts_file}'s sentences, about {a.prompt_tokens[0]}-{a.prompt_tokens[1]} tokens each"
    warm, groups, repeats = assign_prompts(len(texts), per_run)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | load average at the start: {_loadavg()} | {len(texts)} prompts "
          f"from {source}, {a.output_len} new tokens, greedy, ignore_eos", flush=True)
    if repeats:
        print("note: more requests than prompts: some prompts repeat (the prefix cache may serve them)")
    rows: list[Row] = []
    ids: list[list[int]] | None = None
    base_texts: dict[tuple[int, int], str] = {}
    spec: dict[str, list[str]] = {}
    for v in a.variant:
        flags = list(v.flags) if "--model" in v.flags else ["--model", a.model, *v.flags]
        where = f" (from {v.server_dir})" if v.server_dir else ""
        print(f"\n== {v.name}: xlaserve serve {shlex.join(flags)}{where}", flush=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(flags, Path(tmp), v.server_dir or a.server_dir, a.timeout)
            print(f"   healthy after {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                model, v_ids, results, metrics, profiles = asyncio.run(_drive(
                    server.url, texts, warm, list(zip(plan, groups)), a.output_len, a.timeout,
                    "llama-server" in a.anchors))
            finally:
                server.stop()
        if ids is None:
            ids = v_ids
        elif v_ids != ids:
            print(f"   warning: {v.name}'s tokenizer gives other ids than {a.variant[0].name}'s; "
                  "llama.cpp gets the first variant's")
        spec[v.name] = metric_lines(metrics)
        summaries = [summarize(res) for res in results]
        for k, (n, idx, res, s) in enumerate(zip(plan, groups, results, summaries)):
            if v is a.variant[0]:
                base_texts.update({(k, j): r.text for j, r in enumerate(res) if r.ok})
            bad = [r for r, i in zip(res, idx) if r.ok and r.prompt_tokens != len(ids[i])]
            if bad:
                print(f"   warning: {len(bad)} requests' usage.prompt_tokens differ from /tokenize's count")
            for e in sorted({r.error for r in res if r.error})[:3]:
                print(f"   error: {e}")
            print(f"   streams {n:3}: {s['completed']}/{s['requests']} ok, {fmt(s['output_throughput'], '.1f')} "
                  f"out tok/s, TTFT p50 {fmt(s['ttft']['p50'] and s['ttft']['p50'] * 1e3, '.0f')} ms", flush=True)
        for n in a.streams:
            k = median_run(plan, [s["output_throughput"] for s in summaries], n)
            s, res = summaries[k], results[k]
            same = None if v is a.variant[0] else sum(
                r.ok and base_texts.get((k, j)) == r.text for j, r in enumerate(res))
            rows.append(Row(n, v.name, s["completed"], s["requests"], s["output_throughput"],
                            decode_throughput(res), s["ttft"]["p50"], s["itl"]["p50"], same,
                            ttft=s["ttft"], itl=s["itl"], profile=profiles[k]))
    llama: dict[int, dict[str, float]] = {}
    version = server_line = None
    anchor_rows: list[Row] = []
    from benchmarks import baselines

    gguf = Path(a.gguf) if a.gguf else baselines.model_gguf_path(a.model) if a.anchors else None
    if "llama-server" in a.anchors:
        from benchmarks.vs_llama_server import median_rows, run_anchor

        print(f"\n== llama-server: {gguf.name}, {a.threads} threads, the same token ids", flush=True)
        server_line, got = run_anchor(gguf, ids[warm], [(n, [ids[i] for i in idx]) for n, idx in zip(plan, groups)],
                                      a.output_len, a.threads, a.timeout, a.llama_server_binary)
        anchor_rows = median_rows("llama-server", plan, a.streams, got)
    if "llama-cpp-python" in a.anchors:
        print(f"\n== llama.cpp: {gguf.name}, {a.threads} threads, in a child process", flush=True)
        version, got = run_llamacpp(gguf, [(n, [ids[i] for i in idx]) for n, idx in zip(plan, groups)],
                                    a.output_len, a.threads, a.timeout)
        print(f"   {version}")
        for n, m in zip(plan, got):
            print(f"   streams {n:3}: decode {m['decode_tokens_per_s']:.1f} tok/s, "
                  f"e2e {m['e2e_tokens_per_s']:.1f} tok/s", flush=True)
        llama = {n: got[median_run(plan, [m["decode_tokens_per_s"] for m in got], n)] for n in a.streams}
    for r in rows:
        r.llama = llama.get(r.streams, {})
    rows.sort(key=lambda r: (-r.streams, [v.name for v in a.variant].index(r.variant)))
    if anchor_rows:
        print(f"\nAgainst {server_line} (ratios: xlaserve / llama-server):\n"
              + format_anchor_table(rows, anchor_rows))
    if a.anchors != ("llama-server",):
        print("\n" + format_table(rows, a.variant[0].name))
    print("\nLatency (ms):\n" + format_latency_table(sorted(anchor_rows + rows, key=lambda r: -r.streams)))
    if a.closed_loop:
        for r in rows:
            print(f"\nstep profile, {r.variant}, {r.streams} streams:\n  "
                  + format_profile(r.profile).replace("\n", "\n  "))
    for name, lines in spec.items():
        if lines:
            print(f"\n{name} /metrics (speculation):\n  " + "\n  ".join(lines))
    print(f"\nload average at the end: {_loadavg()}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "variants": {v.name: list(v.flags) for v in a.variant}, "llama_cpp": version,
            "llama_server": server_line, "rows": [r.__dict__ for r in rows],
            "llama_server_rows": [r.__dict__ for r in anchor_rows],
            "speculation_metrics": spec}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
