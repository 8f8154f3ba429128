"""lm-evaluation-harness against xlaserve: its loglikelihoods equal a direct forward pass.

    python -m benchmarks.lm_eval_check --lm-eval PATH/TO/bin/lm_eval [--model gemma-3-270m]
        [--batch-size 4] [--tolerance 1e-3] [--output DIR]

Run from the repository root. lm-eval is not a dependency of xlaserve: install it (no torch
needed for API models) into a throwaway virtualenv and pass its ``lm_eval`` executable::

    python -m venv .venv-lmeval && .venv-lmeval/bin/pip install "lm-eval[api]==0.4.13"

What it does:

1. starts ``xlaserve serve --dtype float32`` on a free loopback port (this checkout's code);
2. runs ``lm_eval run --model local-completions --model_args model=M,base_url=URL/v1/completions,
   tokenizer_backend=remote --batch_size 4 --log_samples`` on the local tasks in
   benchmarks/lm_eval_task/ (our own YAML and JSONL; nothing is downloaded: the datasets
   library runs offline): ``xlaserve_mc`` (multiple choice, 8 questions x 4 choices) and
   ``xlaserve_ppl`` (perplexity of 5 sentences), then stops the server;
3. scores every (context, continuation) that lm-eval logged with a direct forward pass of the same
   weights (benchmarks/lm_eval_reference.py: the tokenization lm-eval uses, log-softmax, summed over
   the continuation), and compares: each loglikelihood within ``--tolerance`` (absolute, nats),
   each ``is_greedy`` equal unless the reference's greediest miss is within the tolerance of a tie.

Prints lm-eval's own table, the server's request and prompt-token counters (``/metrics``), then
per task the largest and mean difference, the greedy agreement and the multiple-choice accuracy
from both; exits 1 if a loglikelihood or greedy flag disagrees, if the server did not get the
expected number of requests (the multiple-choice ones ``--batch-size`` prompts per request), or
lm-eval fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = Path("benchmarks") / "lm_eval_task"  # relative to the repository root, as the YAML's data paths
TASKS = ("xlaserve_mc", "xlaserve_ppl")
# The server's shape: that of tests/e2e/test_server_e2e.py, so its compiled programs are reused.
SERVER_ARGS = ["--dtype", "float32", "--max-slots", "8", "--num-pages", "1024", "--max-model-len", "2048"]
STARTUP_TIMEOUT_S = 600.0


@dataclass
class Logged:
    """One loglikelihood lm-eval logged (``--log_samples``)."""

    task: str
    doc_id: int
    context: str | None  # None: a perplexity text, scored after the BOS id
    continuation: str
    logprob: float
    is_greedy: bool | None  # None for perplexity requests (lm-eval logs only the sum)
    target: int | None = None  # multiple choice: the index of the right choice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str, log_path: Path, db_path: Path):
    """``xlaserve serve`` from this checkout until /health is 200; yields its URL; stopped on exit.

    Raises:
      RuntimeError: the server exited or was not healthy within STARTUP_TIMEOUT_S (its log's tail).
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "serving.cli.main", "--log-level", "WARNING", "serve", "--model", model,
           *SERVER_ARGS, "--port", str(port), "--database-url", f"sqlite:///{db_path}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy:\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_lm_eval(lm_eval: str, url: str, model_id: str, batch_size: int, out: Path) -> str:
    """Runs lm-eval's CLI on TASKS against ``url``; returns its stdout (the results table).

    Raises:
      RuntimeError: lm-eval exited non-zero (with its output's tail).
    """
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(out / "hf"),
               TOKENIZERS_PARALLELISM="false")
    env.pop("OPENAI_API_KEY", None)
    cmd = [lm_eval, "run", "--model", "local-completions",
           "--model_args", f"model={model_id},base_url={url}/v1/completions,tokenizer_backend=remote",
           "--tasks", *TASKS, "--include_path", str(TASK_DIR), "--batch_size", str(batch_size),
           "--log_samples", "--output_path", str(out / "lm_eval")]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"lm_eval exited {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}")
    return p.stdout


def server_counters(url: str) -> dict[str, float]:
    """The gateway's request and prompt-token counters (``/metrics``), summed over their labels."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in ("xlaserve:requests_total", "xlaserve:prompt_tokens_total",
                     "xlaserve:cached_prompt_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def read_samples(out: Path) -> list[Logged]:
    """The loglikelihoods in lm-eval's ``samples_<task>_*.jsonl`` files under ``out``."""
    logged = []
    for task in TASKS:
        files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        if not files:
            raise RuntimeError(f"lm-eval wrote no samples for {task} under {out}")
        for line in files[-1].read_text().splitlines():
            s = json.loads(line)
            for i, args in enumerate(s["arguments"].values()):
                resp = s["resps"][i][0]
                if task == "xlaserve_ppl":
                    logged.append(Logged(task, s["doc_id"], None, args["arg_0"], float(resp), None))
                else:
                    logprob, greedy = resp
                    logged.append(Logged(task, s["doc_id"], args["arg_0"], args["arg_1"],
                                         float(logprob), str(greedy) == "True", int(s["target"])))
    return logged


def compare(logged: list[Logged], model_name: str, tolerance: float) -> tuple[list[str], bool]:
    """Scores every logged request with the reference; returns (report lines, all agree)."""
    import numpy as np

    from benchmarks.lm_eval_reference import ReferenceScorer, encode_pair
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.loading.model_registry import load_model

    enable_compilation_cache()
    model, tok = load_model(model_name, dtype="float32", progress=False)
    scorer = ReferenceScorer(model)
    ok = True
    lines = []
    for task in TASKS:
        rows = [r for r in logged if r.task == task]
        diffs, greedy_agree, greedy_total, worst = [], 0, 0, None
        ref_by_doc: dict[int, list[float]] = {}
        ours_by_doc: dict[int, list[float]] = {}
        for r in rows:
            if r.context is None:
                ids = getattr(tok, "encode_markup", tok.encode)(r.continuation)
                ids, ctxlen = [tok.bos_id, *ids], 1
            else:
                ctx, cont = encode_pair(tok, r.context, r.continuation)
                ids, ctxlen = ctx + cont, len(ctx)
            ref = scorer.score(ids, ctxlen)
            ref_by_doc.setdefault(r.doc_id, []).append(ref.logprob)
            ours_by_doc.setdefault(r.doc_id, []).append(r.logprob)
            d = abs(r.logprob - ref.logprob)
            diffs.append(d)
            if worst is None or d > worst[0]:
                worst = (d, r, ref.logprob, len(ids) - ctxlen)
            if d > tolerance:
                ok = False
                lines.append(f"  MISMATCH {task} doc {r.doc_id} {r.continuation!r}: lm-eval "
                             f"{r.logprob:.6f}, reference {ref.logprob:.6f} ({len(ids)} tokens)")
            if r.is_greedy is not None:
                greedy_total += 1
                if r.is_greedy == ref.is_greedy:
                    greedy_agree += 1
                elif ref.max_gap > tolerance:
                    ok = False
                    lines.append(f"  GREEDY MISMATCH {task} doc {r.doc_id} {r.continuation!r}: "
                                 f"lm-eval {r.is_greedy}, reference {ref.is_greedy} (gap {ref.max_gap:.2e})")
        d, r, ref_lp, n_cont = worst
        lines.append(f"{task}: {len(rows)} loglikelihoods; |lm-eval - reference| max {max(diffs):.2e}, "
                     f"mean {float(np.mean(diffs)):.2e} nats (tolerance {tolerance:g}); worst: doc "
                     f"{r.doc_id} {r.continuation[:40]!r} ({n_cont} tokens) lm-eval {r.logprob:.6f}, "
                     f"reference {ref_lp:.6f}")
        if greedy_total:
            lines.append(f"{task}: is_greedy equal for {greedy_agree}/{greedy_total}")
        if task == "xlaserve_mc":
            targets = {r.doc_id: r.target for r in rows}
            acc = {name: np.mean([int(np.argmax(v[d])) == targets[d] for d in targets])
                   for name, v in (("lm-eval", ours_by_doc), ("reference", ref_by_doc))}
            lines.append(f"{task}: acc {acc['lm-eval']:.3f} from lm-eval's loglikelihoods, "
                         f"{acc['reference']:.3f} from the reference's")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval") or "lm_eval",
                    help="the lm_eval executable (default: the one on PATH)")
    ap.add_argument("--model", default="gemma-3-270m", help="the model to serve and score")
    ap.add_argument("--batch-size", type=int, default=4, help="lm-eval's --batch_size (prompts per request)")
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest |lm-eval - reference| per summed loglikelihood, nats")
    ap.add_argument("--output", help="keep lm-eval's output and the server log here (default: a temp dir)")
    args = ap.parse_args(argv)

    out = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="lm_eval_check_"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with serve(args.model, out / "server.log", out / "ledger.db") as url:
        model_id = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        t_served = time.perf_counter()
        table = run_lm_eval(args.lm_eval, url, model_id, args.batch_size, out)
        t_eval = time.perf_counter() - t_served
        counters = server_counters(url)
    print(table)
    logged = read_samples(out / "lm_eval")
    lines, ok = compare(logged, args.model, args.tolerance)
    # lm-eval sends the multiple-choice loglikelihoods --batch_size prompts per request, and each
    # perplexity text (one window) in a request of its own.
    n_mc = sum(r.task == "xlaserve_mc" for r in logged)
    expected = -(-n_mc // args.batch_size) + sum(r.task == "xlaserve_ppl" for r in logged)
    requests = int(counters.get("xlaserve:requests_total", 0))
    ok = ok and requests == expected
    print(f"server up in {t_served - t0:.0f} s; lm-eval ran {t_eval:.0f} s")
    print(f"server: {requests} completions requests (expected {expected}: {n_mc} multiple-choice "
          f"loglikelihoods {args.batch_size} per request, one per perplexity text), "
          f"{int(counters.get('xlaserve:prompt_tokens_total', 0))} prompt tokens, "
          f"{int(counters.get('xlaserve:cached_prompt_tokens_total', 0))} of them prefix-cache hits")
    print("\n".join(lines))
    print("PASS" if ok else "FAIL", f"(output in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
