"""benchmarks.vs_llamacpp without servers or llama.cpp: arguments, prompts, statistics, the table,
and the child process's SIGILL fallback (with a stand-in child)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest

from benchmarks.load import RequestResult
from benchmarks.vs_llamacpp import (
    PROSE_PROMPTS,
    Row,
    Variant,
    assign_prompts,
    decode_throughput,
    format_table,
    interval_union,
    load_prompts,
    median_run,
    metric_lines,
    parse_args,
    parse_variant,
    run_llamacpp,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_variants_split_flags_as_a_shell_does():
    assert parse_variant("base=") == Variant("base", ())
    assert parse_variant("int8=--quantization int8") == Variant("int8", ("--quantization", "int8"))
    assert parse_variant("""spec='--speculative ngram' --chat-template "a b.jinja" """) == Variant(
        "spec", ("--speculative ngram", "--chat-template", "a b.jinja"))
    assert parse_variant(f"before@{BENCHMARKS}=--dtype float32") == Variant(
        "before", ("--dtype", "float32"), BENCHMARKS.resolve())
    for bad in ("no-equals", "=--dtype float32", "x=--served-model-name 'open", "x@=", "x@/no/such/dir="):
        with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
            parse_variant(bad)


def test_arguments_defaults_and_refusals(capsys):
    a = parse_args([])
    assert a.variant == [Variant("base", ())] and a.streams == [32, 1] and a.output_len == 128
    assert a.prompts_file == str(PROSE_PROMPTS) and a.llamacpp and a.rounds == 1
    a = parse_args(["--variant", "b=", "--variant", "i=--quantization int8", "--streams", "8", "--no-llamacpp"])
    assert [v.name for v in a.variant] == ["b", "i"] and a.streams == [8] and not a.llamacpp
    for argv, message in [(["--variant", "x=", "--variant", "x=--dtype float32"], "names must differ"),
                          (["--variant", "x=--port 9000"], "may not set --port"),
                          (["--variant", "x=--port=9000"], "may not set --port"),
                          (["--streams", "0"], "at least 1"), (["--rounds", "0"], "at least 1"),
                          (["--output-len", "1"], "at least 2")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_prose_prompts_are_distinct_sentences_of_about_20_gemma_tokens(gemma_tokenizer):
    prompts = load_prompts(PROSE_PROMPTS)
    assert len(prompts) >= 33 and len(set(prompts)) == len(prompts)
    lengths = [len(gemma_tokenizer.encode(p, add_bos=True)) for p in prompts]
    assert all(18 <= n <= 26 for n in lengths), lengths
    assert all(p[0].isupper() and p.endswith(".") and "<" not in p for p in prompts)
    # The default runs (32 streams, then 1 stream of 4 requests) never repeat a prompt or the warm-up.
    warm, runs, repeats = assign_prompts(len(prompts), [32, 4])
    flat = [i for run in runs for i in run]
    assert not repeats and len(set(flat)) == 36 and warm not in flat and warm == len(prompts) - 1


def test_prompt_assignment_cycles_and_says_so():
    assert assign_prompts(5, [3, 3]) == (4, [[0, 1, 2], [3, 0, 1]], True)
    assert assign_prompts(5, [2, 2]) == (4, [[0, 1], [2, 3]], False)


def test_median_run_picks_among_the_runs_of_one_stream_count():
    runs = [32, 32, 32, 1, 1]
    assert median_run(runs, [3.0, 1.0, 2.0, 9.0, 8.0], 32) == 2
    assert median_run(runs, [3.0, 1.0, 2.0, 9.0, None], 1) == 3  # upper median; None counts as 0


def test_prompt_file_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: no non-empty string 'prompt'"):
        load_prompts(f)
    f.write_text('{"prompt": "only one"}\n')
    with pytest.raises(ValueError, match="at least 2 prompts"):
        load_prompts(f)


def test_decode_throughput_counts_overlapping_streams_once():
    assert interval_union([(0, 2), (1, 3), (5, 6)]) == 4
    assert interval_union([]) == 0
    # Two concurrent streams (first tokens at 1 and 2, ends at 5 and 6) and one after them (10..12).
    rs = [RequestResult(start=0, first_content=1, end=5, completion_tokens=9),
          RequestResult(start=0, first_content=2, end=6, completion_tokens=5),
          RequestResult(start=9, first_content=10, end=12, completion_tokens=7),
          RequestResult(start=0, first_content=1, end=3, completion_tokens=4, error="HTTP 500")]
    assert decode_throughput(rs) == pytest.approx((8 + 4 + 6) / (5 + 2))
    assert decode_throughput([]) is None


def test_metric_lines_keep_speculation_samples_only():
    text = ("# HELP xlaserve:spec_acceptance_rate Accepted drafts.\n"
            "# TYPE xlaserve:spec_acceptance_rate gauge\n"
            'xlaserve:spec_acceptance_rate{model_name="g"} 0.61\n'
            'xlaserve:num_requests_running{model_name="g"} 0.0\n'
            "xlaserve:draft_tokens_total 120.0\n")
    assert metric_lines(text) == ['xlaserve:spec_acceptance_rate{model_name="g"} 0.61',
                                  "xlaserve:draft_tokens_total 120.0"]


def test_table_has_ratios_against_llamacpp():
    llama = {"decode_tokens_per_s": 200.0, "e2e_tokens_per_s": 160.0}
    rows = [Row(32, "base", 32, 32, 240.0, 300.0, 0.8, 0.1, None, llama),
            Row(32, "int8", 31, 32, 320.0, 400.0, 0.7, 0.08, 30, llama),
            Row(1, "base", 0, 4, None, None, None, None, None, {})]
    lines = format_table(rows, "base").splitlines()
    assert lines[0].split(" | ")[-1] == "same text as base |" and lines[1] == "|" + "---|" * 12
    assert lines[2] == "| 32 | base | 32/32 | 240.0 | 300.0 | 800 | 100.0 | 200.0 | 160.0 | 1.20x | 1.50x | - |"
    assert lines[3] == "| 32 | int8 | 31/32 | 320.0 | 400.0 | 700 | 80.0 | 200.0 | 160.0 | 1.60x | 2.00x | 30/32 |"
    assert lines[4] == "| 1 | base | 0/4 | - | - | - | - | - | - | - | - | - |"


def fake_llamacpp_child(conn, gguf, runs, new_tokens, threads, deny_amx):
    """Stands in for _llamacpp_child: dies of SIGILL unless AMX is denied, as an AMX build does on a VM."""
    if not deny_amx:
        os.kill(os.getpid(), signal.SIGILL)
    conn.send((f"fake, {threads} threads, AMX denied",
               [{"decode_tokens_per_s": float(len(p)), "e2e_tokens_per_s": float(new_tokens)} for n, p in runs]))


def failing_llamacpp_child(conn, gguf, runs, new_tokens, threads, deny_amx):
    raise SystemExit(3)


def test_llamacpp_child_is_retried_with_amx_denied_after_sigill(capsys):
    version, out = run_llamacpp("model.gguf", [(2, [[1, 2], [3, 4]]), (1, [[5]])], 8, 2, 120,
                                child=fake_llamacpp_child)
    assert version == "fake, 2 threads, AMX denied"
    assert out == [{"decode_tokens_per_s": 2.0, "e2e_tokens_per_s": 8.0},
                   {"decode_tokens_per_s": 1.0, "e2e_tokens_per_s": 8.0}]
    assert "SIGILL" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_llamacpp("model.gguf", [(1, [[5]])], 8, 2, 120, child=failing_llamacpp_child)


def test_xlaserve_bench_runs_it(capsys):
    from serving.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "vs-llamacpp", "--help"])
    assert e.value.code == 0 and "--variant" in capsys.readouterr().out
