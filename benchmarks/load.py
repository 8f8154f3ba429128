"""Serving load generator for any OpenAI-compatible ``/completions`` endpoint.

Drives xlaserve, a llama.cpp server, vLLM or anything else that speaks the
OpenAI streaming completions API with streaming requests, and reports the
latency and throughput a client sees, one run per load level of a sweep.

Examples::

    # xlaserve (started with: xlaserve serve --model gemma-3-270m --port 8000)
    python -m benchmarks.load --base-url http://127.0.0.1:8000/v1 --model gemma-3-270m \\
        --concurrency 1 8 32 --num-requests 200 --input-len 128 --output-len 128 \\
        --ignore-eos --out results.json --plot results.png

    # llama.cpp (llama-server -m gemma-3-270m-Q4_K_M.gguf --port 8080), Poisson arrivals
    python -m benchmarks.load --base-url http://127.0.0.1:8080/v1 --model gemma-3-270m \\
        --rate 2 4 8 --num-requests 100 --slo-ttft-ms 500 --slo-itl-ms 50

    # your own prompts: one {"prompt": "...", "max_tokens": 64} per line
    python -m benchmarks.load --base-url http://127.0.0.1:8000/v1 --model gemma-3-270m \\
        --prompts-file prompts.jsonl --concurrency 4

Load shapes
  ``--concurrency C ...``: C requests are always in flight (a closed loop);
  ``--rate R ...``: requests arrive as a Poisson process of R requests/s (an
  open loop, no cap on how many are in flight). Each value is one run of
  ``--num-requests`` requests. One warm-up request, not counted, goes first.

Prompts
  Synthetic prompts are random common English words; their length in words
  is drawn from a normal distribution (``--input-len`` mean,
  ``--input-len-std`` standard deviation, at least 1). Words only approximate
  tokens: the lengths reported are the server's ``usage.prompt_tokens`` and
  ``usage.completion_tokens`` (requested with ``stream_options.include_usage``).
  ``--ignore-eos`` sends ``ignore_eos: true`` (a vLLM / xlaserve extension;
  llama.cpp ignores unknown fields) so every request produces ``max_tokens``.

Definitions (per request; seconds in the JSON, milliseconds in the printed table)
  e2e   time from sending the request to the end of the stream (``[DONE]``).
  TTFT  time to first token: from sending the request to the first chunk that
        carries non-empty text.
  ITL   inter-token latency: the gaps between consecutive content chunks after
        the first (a server that sends several tokens per chunk gives fewer,
        longer gaps). Every gap of every request is one sample.
  TPOT  time per output token after the first: (e2e - TTFT) / (completion_tokens - 1),
        for requests with at least 2 completion tokens.

Per run
  request throughput  successful requests / run duration (req/s); the duration
                      runs from the first request's start to the last one's end.
  output throughput   sum of completion_tokens of successful requests / duration (tokens/s).
  goodput             successful requests that met every SLO given
                      (TTFT <= ``--slo-ttft-ms``, the request's own p99 ITL <=
                      ``--slo-itl-ms``) / duration (req/s); reported only when an
                      SLO is given.
  errors              failed requests (HTTP status, SSE error event, or an
                      exception), counted and kept out of the latency statistics.

Percentiles are nearest-rank: the p-th percentile of n sorted samples is the
ceil(p/100 * n)-th smallest sample (no interpolation).

Writes ``--out`` (JSON: the config, and for each run its summary and per-request
records) and, when matplotlib is installed (``pip install -e .[bench]``),
``--plot`` (output tokens/s against p50 TTFT and p50 ITL across the sweep).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# --------------------------------------------------------------------------- statistics


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank q-th percentile (0 < q <= 100) of xs; None when xs is empty."""
    if not xs:
        return None
    s = sorted(xs)
    rank = max(1, math.ceil(q * len(s) / 100))
    return s[min(rank, len(s)) - 1]


def distribution(xs: Sequence[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p99} of xs (all None when xs is empty)."""
    return {"mean": sum(xs) / len(xs) if xs else None, "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


@dataclass
class RequestResult:
    """One request's timeline (``time.perf_counter`` seconds) and outcome."""

    start: float
    end: float | None = None
    first_content: float | None = None  # arrival of the first non-empty text chunk
    content_times: list[float] = field(default_factory=list)  # every non-empty text chunk
    text: str = ""  # the streamed completion text (choice 0), for comparing outputs across servers
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.content_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        return tpot(self.ttft, self.e2e, self.completion_tokens)

    def to_json(self, t0: float) -> dict[str, Any]:
        """The record with times relative to t0 (the run's start) and the derived latencies."""
        rel = lambda t: None if t is None else t - t0  # noqa: E731
        return {"start": rel(self.start), "end": rel(self.end), "ttft": self.ttft, "e2e": self.e2e,
                "tpot": self.tpot, "itl": self.itls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "max_tokens": self.max_tokens,
                "error": self.error}


def tpot(ttft: float | None, e2e: float | None, completion_tokens: int | None) -> float | None:
    """(e2e - TTFT) / (completion_tokens - 1); None without 2 tokens or a TTFT."""
    if ttft is None or e2e is None or completion_tokens is None or completion_tokens < 2:
        return None
    return (e2e - ttft) / (completion_tokens - 1)


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """Whether a successful request met the SLOs (seconds; None = no SLO on that metric).

    The ITL SLO applies to the request's own p99 ITL; a request with no ITL
    sample (one content chunk) meets it. A request without a TTFT fails a TTFT SLO.
    """
    if not r.ok:
        return False
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    if slo_itl is not None:
        p99 = percentile(r.itls, 99)
        if p99 is not None and p99 > slo_itl:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration: float | None = None,
              slo_ttft: float | None = None, slo_itl: float | None = None) -> dict[str, Any]:
    """Per-run summary (seconds, requests/s, tokens/s) of results.

    duration defaults to the span from the earliest start to the latest end.
    """
    ok = [r for r in results if r.ok]
    if duration is None:
        ends = [r.end for r in results if r.end is not None]
        duration = (max(ends) - min(r.start for r in results)) if ends else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    has_slo = slo_ttft is not None or slo_itl is not None
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "completion_tokens": out_tokens,
        "goodput": per_s(sum(meets_slo(r, slo_ttft, slo_itl) for r in ok)) if has_slo else None,
        "slo_ttft_s": slo_ttft,
        "slo_itl_s": slo_itl,
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl": distribution([x for r in ok for x in r.itls]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "e2e": distribution([r.e2e for r in ok]),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_run(label: str, s: dict[str, Any]) -> str:
    """One run's summary as a small table (latencies in milliseconds)."""
    head = (f"== {label}: {s['completed']}/{s['requests']} ok, {s['errors']} errors, "
            f"{_num(s['duration_s'])} s, {_num(s['request_throughput'])} req/s, "
            f"{_num(s['output_throughput'], '.1f')} output tok/s")
    if s["goodput"] is not None:
        head += f", goodput {_num(s['goodput'])} req/s"
    lines = [head, f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "itl", "tpot", "e2e"):
        d = s[name]
        lines.append(f"{name.upper():<6}" + "".join(f"{_ms(d[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """The sweep, one line per run (latencies in milliseconds)."""
    cols = ["load", "req/s", "out tok/s", "goodput", "errors", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "TPOT p50", "E2E p50"]
    rows = [cols]
    for run in runs:
        s = run["summary"]
        rows.append([run["label"], _num(s["request_throughput"]), _num(s["output_throughput"], ".1f"),
                     _num(s["goodput"]), str(s["errors"]), _ms(s["ttft"]["p50"]), _ms(s["ttft"]["p99"]),
                     _ms(s["itl"]["p50"]), _ms(s["itl"]["p99"]), _ms(s["tpot"]["p50"]), _ms(s["e2e"]["p50"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


# --------------------------------------------------------------------------- prompts

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or "
          "one had by word but not what all were we when your can said there use an each which she do "
          "how their if will up other about out many then them these so some her would make like him "
          "into time has look two more write go see number no way could people my than first water been "
          "call who oil its now find long down day did get come made may part over new sound take only "
          "little work know place year live me back give most very after thing our just name good "
          "sentence man think say great where help through much before line right too mean old any same "
          "tell boy follow came want show also around form three small set put end does another well "
          "large must big even such because turn here why ask went men read need land different home us "
          "move try kind hand picture again change off play spell air away animal house point page letter "
          "mother answer found study still learn should world high").split()


def synthetic_prompts(n: int, input_len: float, input_len_std: float, output_len: int,
                      seed: int = 0) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs of random words, lengths ~ N(input_len, input_len_std) >= 1."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(1, round(rng.gauss(input_len, input_len_std) if input_len_std > 0 else input_len))
        out.append((" ".join(rng.choice(_WORDS) for _ in range(k)), output_len))
    return out


def file_prompts(path: str | Path, n: int, default_max_tokens: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs from a JSONL file, cycling through its lines."""
    items = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        d = json.loads(line)
        if not isinstance(d.get("prompt"), str):
            raise ValueError(f"{path}:{i + 1}: no string 'prompt'")
        items.append((d["prompt"], int(d.get("max_tokens") or default_max_tokens)))
    if not items:
        raise ValueError(f"{path}: no prompts")
    return [items[i % len(items)] for i in range(n)]


# --------------------------------------------------------------------------- HTTP driver


@dataclass
class LoadConfig:
    base_url: str
    model: str
    concurrency: list[int] | None = None
    rate: list[float] | None = None
    num_requests: int = 100
    input_len: float = 128
    input_len_std: float = 0.0
    output_len: int = 128
    prompts_file: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    warmup: bool = True
    progress: bool = True
    out: str | None = None
    plot: str | None = None

    def loads(self) -> list[tuple[str, float]]:
        """(mode, value) for each run of the sweep."""
        if self.rate:
            return [("rate", float(r)) for r in self.rate]
        return [("concurrency", int(c)) for c in (self.concurrency or [1])]


def _payload(cfg: LoadConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client, url: str, body: dict[str, Any]) -> RequestResult:
    """Streams one completion; never raises (failures land in ``error``)."""
    r = RequestResult(start=time.perf_counter(), max_tokens=body.get("max_tokens"))
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:200]}"
                return r
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.end = time.perf_counter()
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return r
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        if r.first_content is None:
                            r.first_content = now
                        r.content_times.append(now)
                        r.text += choice["text"]
                        break
                usage = chunk.get("usage")
                if usage:
                    r.prompt_tokens = usage.get("prompt_tokens")
                    r.completion_tokens = usage.get("completion_tokens")
            if not done:
                r.error = "stream ended without [DONE]"
                return r
        if r.completion_tokens is None:  # server sent no usage: count content chunks
            r.completion_tokens = len(r.content_times)
    except Exception as e:  # noqa: BLE001 - every failure is a counted error
        r.error = f"{type(e).__name__}: {e}"
    return r


async def _run_one(cfg: LoadConfig, client, url: str, mode: str, value: float,
                   prompts: list[tuple[str, int]]) -> list[RequestResult]:
    from tqdm import tqdm

    bar = tqdm(total=len(prompts), desc=f"{mode}={value:g}", disable=not cfg.progress, leave=False)
    results: list[RequestResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        prompt, max_tokens = prompts[i]
        results[i] = await send_request(client, url, _payload(cfg, prompt, max_tokens))
        bar.update(1)

    try:
        if mode == "concurrency":
            next_i = iter(range(len(prompts)))

            async def worker() -> None:
                for i in next_i:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(int(value), len(prompts)))))
        else:
            rng = random.Random(cfg.seed + 1)
            tasks, t_next = [], time.perf_counter()
            for i in range(len(prompts)):
                delay = t_next - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
                t_next += rng.expovariate(value)
            await asyncio.gather(*tasks)
    finally:
        bar.close()
    return results  # type: ignore[return-value]


async def run_benchmark(cfg: LoadConfig) -> dict[str, Any]:
    """Runs the sweep; returns {"config", "runs": [{mode, value, label, summary, requests}]}.

    Prints each run's table and the sweep table, writes ``cfg.out`` / ``cfg.plot`` when set.
    Raises RuntimeError when the warm-up request fails.
    """
    import httpx

    url = cfg.base_url.rstrip("/") + "/completions"
    if cfg.prompts_file:
        prompts = file_prompts(cfg.prompts_file, cfg.num_requests, cfg.output_len)
    else:
        prompts = synthetic_prompts(cfg.num_requests, cfg.input_len, cfg.input_len_std, cfg.output_len, cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    slo_ttft = None if cfg.slo_ttft_ms is None else cfg.slo_ttft_ms / 1e3
    slo_itl = None if cfg.slo_itl_ms is None else cfg.slo_itl_ms / 1e3
    max_conn = max([int(v) for m, v in cfg.loads() if m == "concurrency"] + [1000 if cfg.rate else 1])
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    runs = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), headers=headers,
                                 limits=limits) as client:
        if cfg.warmup:
            w = await send_request(client, url, _payload(cfg, prompts[0][0], min(prompts[0][1], 16)))
            if not w.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {w.error}")
        for mode, value in cfg.loads():
            results = await _run_one(cfg, client, url, mode, value, prompts)
            t0 = min(r.start for r in results)
            summary = summarize(results, slo_ttft=slo_ttft, slo_itl=slo_itl)
            label = f"{mode} {value:g}" + (" req/s" if mode == "rate" else "")
            errors = sorted({r.error for r in results if r.error})
            run = {"mode": mode, "value": value, "label": label, "summary": summary,
                   "requests": [r.to_json(t0) for r in results]}
            runs.append(run)
            print(format_run(label, summary), flush=True)
            for e in errors[:5]:
                print(f"   error: {e}", flush=True)
    config = dataclasses.asdict(cfg)
    if config["api_key"]:
        config["api_key"] = "<redacted>"
    report = {"config": config, "runs": runs}
    print("\n" + format_sweep(runs), flush=True)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {cfg.out}")
    if cfg.plot:
        plot(runs, cfg.plot)
    return report


def plot(runs: Sequence[dict[str, Any]], path: str) -> bool:
    """Output tokens/s against p50 TTFT and p50 ITL across the sweep; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install -e .[bench]); skipped the plot {path}")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft", "itl")):
        pts = [(r["summary"]["output_throughput"], r["summary"][metric]["p50"], r["label"]) for r in runs]
        pts = [(x, y * 1e3, lab) for x, y, lab in pts if x is not None and y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        for x, y, lab in pts:
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"p50 {metric.upper()} (ms)")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> LoadConfig:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.splitlines()[0],
                                 epilog="Definitions and examples: see the module docstring (benchmarks/load.py).")
    ap.add_argument("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="the request's model field")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", help="fixed-concurrency sweep (default: 1)")
    load.add_argument("--rate", type=float, nargs="+", help="Poisson arrival-rate sweep, requests/s")
    ap.add_argument("--num-requests", type=int, default=100, help="requests per run (default: 100)")
    ap.add_argument("--input-len", type=float, default=128,
                    help="synthetic prompt length, mean, in words ~ tokens (default: 128)")
    ap.add_argument("--input-len-std", type=float, default=0.0, help="its standard deviation (default: 0)")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    ap.add_argument("--prompts-file", help='JSONL, one {"prompt": ..., "max_tokens": ...} per line')
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM/xlaserve extension)")
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on TTFT, ms")
    ap.add_argument("--slo-itl-ms", type=float, help="goodput SLO on a request's p99 ITL, ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s (default: 600)")
    ap.add_argument("--api-key", help="sent as a Bearer token")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--out", help="write all runs as JSON here")
    ap.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    a = ap.parse_args(argv)
    for name in ("concurrency", "rate"):
        if any(v <= 0 for v in getattr(a, name) or []):
            ap.error(f"--{name} values must be positive")
    if a.num_requests < 1 or a.output_len < 1:
        ap.error("--num-requests and --output-len must be at least 1")
    return LoadConfig(base_url=a.base_url, model=a.model, concurrency=a.concurrency, rate=a.rate,
                      num_requests=a.num_requests, input_len=a.input_len, input_len_std=a.input_len_std,
                      output_len=a.output_len, prompts_file=a.prompts_file, temperature=a.temperature,
                      ignore_eos=a.ignore_eos, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms,
                      seed=a.seed, timeout_s=a.timeout, api_key=a.api_key, warmup=not a.no_warmup,
                      progress=not a.no_progress, out=a.out, plot=a.plot)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        asyncio.run(run_benchmark(cfg))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
