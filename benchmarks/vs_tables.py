"""The tables of ``benchmarks.vs_llamacpp``: one row per (stream count, side), Markdown out.

``format_table``: our variants against the llama-cpp-python batched decode
(its decode and end-to-end tokens/s, the ratios); ``format_latency_table``:
TTFT and ITL p50 / p90 / p99 per row; ``format_anchor_table``: our variants
against llama-server through the same HTTP load, each side's tokens/s, TTFT and
ITL p50 / p99, and xlaserve / llama-server ratios; ``decode_throughput`` and
``median_run``, the numbers both sides' rows are made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from benchmarks.load import RequestResult


@dataclass
class Row:
    """One (stream count, variant) cell of the table; llama.cpp's numbers are shared per stream count."""

    streams: int
    variant: str
    ok: int
    requests: int
    out_tps: float | None
    decode_tps: float | None
    ttft_p50: float | None  # seconds
    itl_p50: float | None  # seconds
    same_text: int | None = None
    llama: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, float | None] = field(default_factory=dict)  # benchmarks.load.distribution, seconds
    itl: dict[str, float | None] = field(default_factory=dict)
    profile: dict[str, float] = field(default_factory=dict)  # closed_loop.profile_delta of the run


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or "-" for None."""
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[Row], base_variant: str) -> str:
    """The results as a Markdown table (tokens/s, milliseconds, ratios to llama.cpp)."""
    head = ["streams", "variant", "ok", "out tok/s", "decode tok/s", "TTFT p50 ms", "ITL p50 ms",
            "llama.cpp decode tok/s", "llama.cpp e2e tok/s", "out / llama decode", "out / llama e2e",
            f"same text as {base_variant}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ld, le = r.llama.get("decode_tokens_per_s"), r.llama.get("e2e_tokens_per_s")
        ratio = lambda d: None if r.out_tps is None or not d else r.out_tps / d  # noqa: E731
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        cells = [str(r.streams), r.variant, f"{r.ok}/{r.requests}", fmt(r.out_tps, ".1f"), fmt(r.decode_tps, ".1f"),
                 fmt(ms(r.ttft_p50), ".0f"), fmt(ms(r.itl_p50), ".1f"), fmt(ld, ".1f"), fmt(le, ".1f"),
                 fmt(ratio(ld), ".2f") + ("x" if ratio(ld) is not None else ""),
                 fmt(ratio(le), ".2f") + ("x" if ratio(le) is not None else ""),
                 "-" if r.same_text is None else f"{r.same_text}/{r.requests}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_latency_table(rows: Sequence[Row]) -> str:
    """TTFT and ITL p50 / p90 / p99 per row, in milliseconds, as a Markdown table."""
    head = ["streams", "variant", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [fmt(None if d.get(q) is None else d[q] * 1e3, ".1f") for d in (r.ttft, r.itl)
                 for q in ("p50", "p90", "p99")]
        lines.append("| " + " | ".join([str(r.streams), r.variant, *cells]) + " |")
    return "\n".join(lines)


ANCHOR = "llama-server"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def format_anchor_table(rows: Sequence[Row], anchor: Sequence[Row]) -> str:
    """Our variants against llama-server as a Markdown table: per stream count, llama-server's
    row, then each variant's with the ratios xlaserve / llama-server of output tokens/s, decode
    tokens/s, TTFT p50 and ITL p50 (above 1x: more tokens/s, or a longer latency). Latencies in
    milliseconds; a stream count without an anchor row gets no ratios ("-")."""
    head = ["streams", "server", "ok", "out tok/s", "decode tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "out tok/s ratio", "decode tok/s ratio", "TTFT p50 ratio", "ITL p50 ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_streams = {r.streams: r for r in anchor}
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    for n in sorted({r.streams for r in [*rows, *anchor]}, reverse=True):
        ref = by_streams.get(n)
        for r in ([ref] if ref else []) + [r for r in rows if r.streams == n]:
            cells = [str(n), r.variant if r is ref else f"xlaserve {r.variant}", f"{r.ok}/{r.requests}",
                     fmt(r.out_tps, ".1f"), fmt(r.decode_tps, ".1f"), fmt(ms(r.ttft.get("p50")), ".0f"),
                     fmt(ms(r.ttft.get("p99")), ".0f"), fmt(ms(r.itl.get("p50")), ".1f"),
                     fmt(ms(r.itl.get("p99")), ".1f")]
            if r is ref or ref is None:
                cells += ["-"] * 4
            else:
                cells += [_ratio(r.out_tps, ref.out_tps), _ratio(r.decode_tps, ref.decode_tps),
                          _ratio(r.ttft.get("p50"), ref.ttft.get("p50")), _ratio(r.itl.get("p50"), ref.itl.get("p50"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_union(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by [start, end] intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def decode_throughput(results: Sequence[RequestResult]) -> float | None:
    """Tokens after each stream's first / the union of its [first token, end] intervals (tokens/s)."""
    ok = [r for r in results if r.ok and r.first_content is not None and r.completion_tokens]
    span = interval_union([(r.first_content, r.end) for r in ok])
    return sum(r.completion_tokens - 1 for r in ok) / span if span > 0 else None


def median_run(runs: Sequence[int], values: Sequence[float | None], streams: int) -> int:
    """Index of the median (upper, for an even count) of ``values`` among the runs of ``streams`` streams."""
    ks = sorted((k for k, n in enumerate(runs) if n == streams), key=lambda k: values[k] or 0.0)
    return ks[len(ks) // 2]
