"""benchmarks.vs_llamacpp without servers or llama.cpp: arguments, prompts, statistics, the tables,
the child process's SIGILL fallback (with a stand-in child), and the llama-server anchor without
building llama.cpp: the cmake command lines and the build's caching (a stand-in cmake), the
server's command line, its process kept and killed (a stand-in binary, SIGILL included), the
requests and SSE parsing against a fake llama-server on loopback."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from benchmarks import llama_server as ls
from benchmarks import vs_llama_server as vls
from benchmarks.load import RequestResult
from benchmarks.vs_llamacpp import (
    PROSE_PROMPTS,
    Row,
    Variant,
    assign_prompts,
    decode_throughput,
    format_anchor_table,
    format_table,
    interval_union,
    load_prompts,
    median_run,
    metric_lines,
    parse_args,
    parse_variant,
    run_llamacpp,
)
from tests.support.fake_llama_server import FakeLlamaServer

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


# --------------------------------------------------------------------------- the llama-server anchor


def test_cmake_configures_without_downloads_and_builds_only_the_server(tmp_path):
    cmd = ls.configure_command(tmp_path / "src", tmp_path / "build", "Ninja")
    assert cmd[:7] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build"), "-G", "Ninja"]
    opts = dict(o[2:].split("=", 1) for o in cmd[7:])
    assert len(opts) == len(cmd) - 7 and all(o.startswith("-D") for o in cmd[7:])
    assert {k: opts[k] for k in ("CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS", "GGML_NATIVE", "LLAMA_OPENSSL", "LLAMA_CURL",
                                 "LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_UI", "LLAMA_BUILD_TESTS",
                                 "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_SERVER", "LLAMA_BUILD_TOOLS")} == {
        "CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF", "GGML_NATIVE": "ON", "LLAMA_OPENSSL": "OFF",
        "LLAMA_CURL": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_BUILD_UI": "OFF", "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "ON", "LLAMA_BUILD_TOOLS": "ON"}
    assert "-G" not in ls.configure_command(tmp_path, tmp_path / "b")
    assert "-DGGML_NATIVE=OFF" in ls.configure_command(tmp_path, tmp_path / "b", options={"GGML_NATIVE": "OFF"})
    assert ls.build_command(tmp_path, 2) == ["cmake", "--build", str(tmp_path), "--target", "llama-server", "-j", "2"]


def test_server_command_and_its_context(tmp_path):
    assert ls.context_size(32, 430, 128) == 32 * 768 and ls.context_size(1, 120, 128) == 256
    cmd = ls.server_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8123, 32, 2, 32 * 768)
    assert cmd[0] == str(tmp_path / "llama-server")
    flags = " ".join(cmd[1:])
    assert flags == (f"-m {tmp_path / 'm.gguf'} --host 127.0.0.1 --port 8123 -np 32 -cb -t 2 -tb 2 -c 24576 "
                     "--no-webui")


def _sdist_with(tmp_path, files: dict[str, str]) -> Path:
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return sdist


def test_build_runs_cmake_once_then_reuses_the_binary(tmp_path, monkeypatch):
    """ensure_built with a stand-in cmake on PATH: extracts only vendor/llama.cpp, configures, builds
    the llama-server target, caches the binary; a second call builds nothing; a failed build raises
    with the log's tail."""
    monkeypatch.setenv("XLASERVE_DATA_DIR", str(tmp_path / "data"))
    prefix = f"llama_cpp_python-{ls.SDIST_VERSION}/"
    sdist = _sdist_with(tmp_path, {prefix + "vendor/llama.cpp/CMakeLists.txt": "project(x)\n",
                                   prefix + "vendor/llama.cpp/tools/server/main.cpp": "int main(){}\n",
                                   prefix + "setup.py": "\n"})
    monkeypatch.setattr(ls, "fetch_sdist", lambda folder: sdist)
    tools = tmp_path / "tools"
    tools.mkdir()
    calls = tmp_path / "calls"
    (tools / "cmake").write_text(  # configure: checks the sources; build: writes build/bin/llama-server
        f'#!/bin/sh\necho "$@" >> {calls}\n[ -n "$FAIL_CMAKE" ] && echo "error: no compiler" && exit 2\n'
        'if [ "$1" = "-S" ]; then test -f "$2/CMakeLists.txt" || exit 3; exit 0; fi\n'
        'mkdir -p "$2/bin" && printf "#!/bin/sh\\n" > "$2/bin/llama-server" && chmod +x "$2/bin/llama-server"\n')
    (tools / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setattr(ls.shutil, "which", lambda name: str(tools / name) if name == "cmake" else None)
    lines = []
    binary = ls.ensure_built(jobs=3, nice=0, log=lines.append)
    root = ls.install_root()
    assert binary == root / "bin" / "llama-server" and os.access(binary, os.X_OK)
    assert sorted(p.name for p in (root / "src").iterdir()) == [".complete", "CMakeLists.txt", "tools"]
    made = calls.read_text().splitlines()
    assert len(made) == 2 and made[0].startswith(f"-S {root / 'src'} -B {root / 'build'} -DCMAKE_BUILD_TYPE=Release")
    assert made[1] == f"--build {root / 'build'} --target llama-server -j 3"
    assert "not built yet" in lines[0] and lines[1].startswith("llama-server: built in ")
    assert ls.ensure_built(log=lines.append) == binary and len(calls.read_text().splitlines()) == 2
    binary.unlink()
    monkeypatch.setenv("FAIL_CMAKE", "1")
    with pytest.raises(RuntimeError, match=r"cmake -S failed \(exit 2\)(.|\n)*error: no compiler"):
        ls.ensure_built(log=lines.append)


@pytest.fixture
def fake_server():
    servers = []

    def start(close: bool = True) -> FakeLlamaServer:
        srv = FakeLlamaServer(close=close)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("close", [True, False])
def test_llama_server_load_sends_token_ids_and_one_connection_per_request(fake_server, close):
    """The requests (prompt as token ids, max_tokens, greedy, ignore_eos, streamed with usage), the
    parsed SSE chunks, and a new connection per request whether or not the server closes it."""
    srv = fake_server(close)
    runs = [(2, [[2, 10, 11], [2, 12], [2, 13, 14, 15]]), (1, [[2, 16]])]
    model, results = asyncio.run(vls.drive(srv.url, [2, 9], runs, 5, 30.0))
    assert model == "fake-gemma.gguf"
    posts = [b for path, b in srv.bodies if path == "/v1/completions"]
    assert posts[0]["prompt"] == [2, 9] and posts[-1]["prompt"] == [2, 16]  # warm-up first; 2 streams
    assert sorted(b["prompt"] for b in posts[1:4]) == [[2, 10, 11], [2, 12], [2, 13, 14, 15]]
    assert next(b for b in posts if b["prompt"] == [2, 10, 11]) == {
        "model": "fake-gemma.gguf", "prompt": [2, 10, 11], "max_tokens": 5, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert posts[0]["max_tokens"] == 16
    assert srv.connections == 1 + len(posts)  # GET /v1/models, then one per completion
    flat = [r for res in results for r in res]
    assert [len(res) for res in results] == [3, 1] and all(r.ok for r in flat)
    assert all(r.text == " t0 t1 t2 t3 t4" and r.completion_tokens == 5 and len(r.content_times) == 5 for r in flat)
    assert [r.prompt_tokens for r in flat] == [3, 2, 4, 2]
    assert all(0 < r.ttft <= r.e2e and len(r.itls) == 4 for r in flat)
    rows = vls.median_rows("llama-server", [2, 1], [2, 1], results)
    assert [(r.streams, r.ok, r.requests) for r in rows] == [(2, 3, 3), (1, 1, 1)]
    assert rows[0].itl["p50"] is not None and rows[0].out_tps > 0


def _fake_binary(tmp_path, *flags: str) -> Path:
    script = Path(__file__).resolve().parents[1] / "support" / "fake_llama_server.py"
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {script} {" ".join(flags)} "$@"\n')
    binary.chmod(0o755)
    return binary


def test_llama_server_process_is_waited_for_and_killed(tmp_path):
    with ls.LlamaServer(_fake_binary(tmp_path), tmp_path / "m.gguf", tmp_path, 4, 2, 1024, timeout_s=30) as srv:
        import httpx

        assert httpx.get(f"{srv.url}/health").status_code == 200 and not srv.amx_denied
        assert srv.command[srv.command.index("-np") + 1] == "4"
    assert srv.proc.returncode is not None
    with pytest.raises(RuntimeError, match="exited with 7(.|\n)*failing on purpose"):
        ls.LlamaServer(_fake_binary(tmp_path, "--exit", "7"), tmp_path / "m.gguf", tmp_path, 1, 2, 256, 30)


@pytest.mark.parametrize("sig", ["SIGILL", "SIGSEGV"])
def test_llama_server_that_dies_of_an_amx_fault_is_started_again_with_amx_denied(tmp_path, capsys, sig):
    srv = ls.LlamaServer(_fake_binary(tmp_path, "--die-unless-seccomp", sig), tmp_path / "m.gguf", tmp_path, 1, 2,
                         256, timeout_s=30)
    try:
        assert srv.amx_denied and f"died of {sig}" in capsys.readouterr().out
    finally:
        srv.stop()
    assert srv.proc.returncode is not None


def test_anchor_table_has_both_sides_and_ratios():
    ttft, itl = {"p50": 0.5, "p99": 2.0}, {"p50": 0.1, "p99": 0.4}
    anchor = [Row(32, "llama-server", 64, 64, 200.0, 210.0, 0.5, 0.1, ttft=ttft, itl=itl),
              Row(1, "llama-server", 4, 4, 50.0, 60.0, 0.05, 0.02, ttft={"p50": 0.05, "p99": 0.06},
                  itl={"p50": 0.02, "p99": 0.03})]
    rows = [Row(32, "base", 64, 64, 100.0, 105.0, 1.0, 0.2, ttft={"p50": 1.0, "p99": 3.0},
                itl={"p50": 0.2, "p99": 0.5}),
            Row(1, "base", 3, 4, None, None, None, None)]
    lines = format_anchor_table(rows, anchor).splitlines()
    assert lines[0].startswith("| streams | server | ok | out tok/s |") and lines[1] == "|" + "---|" * 13
    assert lines[2] == "| 32 | llama-server | 64/64 | 200.0 | 210.0 | 500 | 2000 | 100.0 | 400.0 | - | - | - | - |"
    assert lines[3] == ("| 32 | xlaserve base | 64/64 | 100.0 | 105.0 | 1000 | 3000 | 200.0 | 500.0 "
                        "| 0.50x | 0.50x | 2.00x | 2.00x |")
    assert lines[4] == "| 1 | llama-server | 4/4 | 50.0 | 60.0 | 50 | 60 | 20.0 | 30.0 | - | - | - | - |"
    assert lines[5] == "| 1 | xlaserve base | 3/4 | - | - | - | - | - | - | - | - | - | - |"


def test_anchor_flag_and_its_default(monkeypatch):
    monkeypatch.setattr(ls, "can_build", lambda: True)
    assert parse_args([]).anchors == ("llama-server",)
    assert parse_args(["--anchor", "both"]).anchors == ("llama-server", "llama-cpp-python")
    assert parse_args(["--anchor", "both", "--no-llamacpp"]).anchors == ()
    monkeypatch.setattr(ls, "can_build", lambda: False)
    assert parse_args([]).anchors == ("llama-cpp-python",)
    assert parse_args(["--llama-server-binary", "/x/llama-server"]).anchors == ("llama-server",)
