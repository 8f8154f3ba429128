"""benchmarks.load: the statistics on hand-made samples, and one sweep against a tiny-random server."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from benchmarks.load import (
    LoadConfig,
    RequestResult,
    distribution,
    file_prompts,
    format_run,
    format_sweep,
    meets_slo,
    parse_args,
    percentile,
    plot,
    run_benchmark,
    summarize,
    synthetic_prompts,
    tpot,
)


def req(start, ttft, itls, tokens, prompt=5, error=None):
    """A successful (or failed) RequestResult from relative timings."""
    first = start + ttft
    times = [first]
    for gap in itls:
        times.append(times[-1] + gap)
    return RequestResult(start=start, end=None if error else times[-1], first_content=first, content_times=times,
                         prompt_tokens=prompt, completion_tokens=tokens, error=error)


# --------------------------------------------------------------------------- statistics


def test_percentile_is_nearest_rank():
    xs = list(range(1, 11))  # 1..10
    assert percentile(xs, 50) == 5
    assert percentile(xs, 90) == 9
    assert percentile(xs, 99) == 10
    assert percentile(xs, 100) == 10
    assert percentile(xs, 1) == 1
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    xs = list(range(1, 101))
    assert [percentile(xs, q) for q in (50, 90, 99)] == [50, 90, 99]
    assert percentile(list(range(1, 100)), 99) == 99  # ceil(0.99 * 99) = 99: the maximum


def test_distribution():
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d == {"mean": 2.5, "p50": 2.0, "p90": 4.0, "p99": 4.0}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot():
    assert tpot(0.1, 1.1, 11) == pytest.approx(0.1)
    assert tpot(0.1, 0.1, 1) is None  # needs two tokens
    assert tpot(None, 1.0, 5) is None
    r = req(0.0, 0.2, [0.05, 0.05, 0.1], tokens=4)
    assert r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.2 / 3)
    assert r.itls == pytest.approx([0.05, 0.05, 0.1])


def test_summary_throughput_and_latency():
    rs = [req(0.0, 0.1, [0.1, 0.1], tokens=3), req(1.0, 0.3, [0.2], tokens=2),
          req(0.5, 0.1, [], tokens=1, error="HTTP 500: boom")]
    s = summarize(rs)
    assert s["requests"] == 3 and s["completed"] == 2 and s["errors"] == 1
    assert s["duration_s"] == pytest.approx(1.5)  # first start 0.0, last end 1.5
    assert s["request_throughput"] == pytest.approx(2 / 1.5)
    assert s["output_throughput"] == pytest.approx(5 / 1.5)
    assert s["completion_tokens"] == 5 and s["prompt_tokens"] == 10
    assert s["ttft"]["mean"] == pytest.approx(0.2) and s["ttft"]["p50"] == pytest.approx(0.1)
    assert s["ttft"]["p99"] == pytest.approx(0.3)
    assert s["itl"]["p50"] == pytest.approx(0.1) and s["itl"]["p99"] == pytest.approx(0.2)
    assert s["tpot"]["p50"] == pytest.approx(0.1) and s["tpot"]["p99"] == pytest.approx(0.2)
    assert s["e2e"]["p99"] == pytest.approx(0.5)
    assert s["goodput"] is None  # no SLO given
    assert summarize(rs, duration=2.0)["request_throughput"] == pytest.approx(1.0)


def test_goodput_with_slos():
    fast = req(0.0, 0.05, [0.01] * 99, tokens=100)
    slow_first = req(0.0, 0.5, [0.01] * 9, tokens=10)
    one_slow_gap = req(0.0, 0.05, [0.01] * 99 + [0.5], tokens=101)  # p99 of 100 gaps = 99th smallest
    two_slow_gaps = req(0.0, 0.05, [0.01] * 98 + [0.5, 0.5], tokens=101)
    single = req(0.0, 0.05, [], tokens=1)  # no ITL sample: meets any ITL SLO
    failed = req(0.0, 0.01, [], tokens=1, error="ReadTimeout: x")
    rs = [fast, slow_first, one_slow_gap, two_slow_gaps, single, failed]

    assert meets_slo(fast, 0.1, 0.02)
    assert not meets_slo(slow_first, 0.1, None) and meets_slo(slow_first, None, 0.02)
    assert meets_slo(one_slow_gap, 0.1, 0.02)
    assert not meets_slo(two_slow_gaps, None, 0.02)
    assert meets_slo(single, 0.1, 0.02)
    assert not meets_slo(failed, None, None)
    assert not meets_slo(RequestResult(start=0.0, end=1.0, completion_tokens=0), 1.0, None)  # no TTFT

    s = summarize(rs, duration=2.0, slo_ttft=0.1, slo_itl=0.02)
    assert s["goodput"] == pytest.approx(3 / 2.0)  # fast, one_slow_gap, single
    assert s["request_throughput"] == pytest.approx(5 / 2.0)
    assert summarize(rs, duration=2.0, slo_ttft=0.1)["goodput"] == pytest.approx(4 / 2.0)
    assert summarize(rs, duration=2.0, slo_itl=0.02)["goodput"] == pytest.approx(4 / 2.0)


def test_formatting_handles_empty_runs():
    s = summarize([req(0.0, 0.1, [], tokens=1, error="x")])
    assert s["completed"] == 0 and s["ttft"]["p50"] is None
    text = format_run("concurrency 1", s)
    assert "TTFT" in text and "-" in text
    assert "concurrency 1" in format_sweep([{"label": "concurrency 1", "summary": s}])


def test_prompts(tmp_path):
    ps = synthetic_prompts(50, 20, 5, 7, seed=1)
    assert len(ps) == 50 and all(m == 7 for _, m in ps)
    lens = [len(p.split()) for p, _ in ps]
    assert min(lens) >= 1 and len(set(lens)) > 1
    assert synthetic_prompts(3, 10, 0, 4) == synthetic_prompts(3, 10, 0, 4)
    assert all(len(p.split()) == 10 for p, _ in synthetic_prompts(3, 10, 0, 4))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b"}\n')
    assert file_prompts(f, 3, 9) == [("a", 3), ("b", 9), ("a", 3)]


def test_parse_args():
    cfg = parse_args(["--base-url", "http://h/v1", "--model", "m", "--rate", "2", "4", "--ignore-eos"])
    assert cfg.loads() == [("rate", 2.0), ("rate", 4.0)] and cfg.ignore_eos
    cfg = parse_args(["--base-url", "http://h/v1", "--model", "m"])
    assert cfg.loads() == [("concurrency", 1)] and not cfg.ignore_eos and cfg.temperature == 0
    with pytest.raises(SystemExit):
        parse_args(["--base-url", "u", "--model", "m", "--rate", "1", "--concurrency", "2"])


def test_plot_without_matplotlib_prints_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert plot([], str(tmp_path / "x.png")) is False
    assert "matplotlib" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------- end to end


def test_sweep_against_tiny_server(tiny_server, tmp_path, capsys):
    out = tmp_path / "results.json"
    cfg = LoadConfig(base_url=f"{tiny_server}/v1", model="tiny-random", concurrency=[1, 4], num_requests=6,
                     input_len=24, input_len_std=4, output_len=8, ignore_eos=True, slo_ttft_ms=60_000,
                     slo_itl_ms=60_000, progress=False, out=str(out))
    report = asyncio.run(run_benchmark(cfg))
    printed = capsys.readouterr().out
    assert "concurrency 1" in printed and "concurrency 4" in printed  # the sweep table

    assert [(r["mode"], r["value"]) for r in report["runs"]] == [("concurrency", 1), ("concurrency", 4)]
    for run in report["runs"]:
        s = run["summary"]
        assert s["errors"] == 0 and s["completed"] == 6
        assert len(run["requests"]) == 6
        for r in run["requests"]:
            assert r["error"] is None
            assert r["completion_tokens"] == 8
            assert r["prompt_tokens"] > 0
            assert r["ttft"] is not None and 0 < r["ttft"] <= r["e2e"]
            assert r["start"] >= 0 and r["end"] > r["start"]
        assert s["completion_tokens"] == 48
        for key in ("duration_s", "request_throughput", "output_throughput", "goodput"):
            assert s[key] > 0, key
        for metric in ("ttft", "tpot", "e2e"):
            assert all(s[metric][k] > 0 for k in ("mean", "p50", "p90", "p99")), metric
        assert s["ttft"]["p99"] <= s["e2e"]["p99"]
    assert "TTFT" in printed and "concurrency 4" in printed

    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 2
    assert saved["config"]["concurrency"] == [1, 4] and saved["config"]["ignore_eos"] is True
    assert saved["runs"][1]["summary"]["completed"] == 6
