"""benchmarks.closed_loop without a server: mixed-length prompts, and the step profile read off /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.closed_loop import TURN_KINDS, TURN_PARTS, format_profile, mixed_prompts, profile_delta, scrape_profile
from benchmarks.vs_llamacpp import PROSE_PROMPTS, load_prompts, parse_args
from serving.contract.engine_client import EngineStats
from serving.gateway.services.metrics import EngineStatsCollector
from serving.runtime import turn_profile


def test_mixed_prompts_spread_from_about_20_to_400_tokens_with_no_shared_prefix(gemma_tokenizer):
    sentences = load_prompts(PROSE_PROMPTS)
    prompts = mixed_prompts(sentences, 65, 20, 400)
    assert len(prompts) == 65 and prompts == mixed_prompts(sentences, 65, 20, 400)  # seeded
    lengths = [len(gemma_tokenizer.encode(p, add_bos=True)) for p in prompts]
    assert 15 <= min(lengths) <= 40 and 330 <= max(lengths) <= 480, (min(lengths), max(lengths))
    short = sum(n < 150 for n in lengths)
    assert 15 <= short <= 40  # spread over the range, not bunched at one end
    assert lengths[:8] != sorted(lengths[:8])  # long and short interleave
    # each opens with its own number: no two share even their first 8 tokens (a prefix-cache page)
    heads = {tuple(gemma_tokenizer.encode(p, add_bos=True)[:8]) for p in prompts}
    assert len(heads) == len(prompts)
    with pytest.raises(ValueError):
        mixed_prompts([], 3)
    with pytest.raises(ValueError):
        mixed_prompts(sentences, 3, 400, 20)


def test_closed_loop_arguments():
    a = parse_args(["--closed-loop", "--streams", "32", "1"])
    assert a.closed_loop and a.prompt_tokens == [20, 400] and a.streams == [32, 1]
    assert not parse_args([]).closed_loop
    with pytest.raises(SystemExit):
        parse_args(["--closed-loop", "--prompt-tokens", "400", "20"])


def _exposition(profile: dict) -> str:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: {"g": lambda: EngineStats(turn_profile=profile)}))
    return generate_latest(registry).decode()


def test_profile_round_trips_through_the_metrics_exposition():
    tp = turn_profile.TurnProfile()
    assert tuple(tp.seconds) == TURN_PARTS and tuple(tp.turns) == TURN_KINDS  # the benchmark's names
    before = scrape_profile(_exposition(tp.snapshot()))
    assert before == {f"seconds.{p}": 0.0 for p in TURN_PARTS} | {f"turns.{k}": 0.0 for k in TURN_KINDS} | {
        "prefill_tokens": 0.0, "decode_rows": 0.0}
    for prefill, decode in [(96, 31), (0, 32), (0, 32), (40, 0)]:
        tp.start_turn()
        tp.add("plan", 0.001)
        tp.add("readback_wait", 0.004)
        tp.end_turn(prefill, decode)
    after = scrape_profile(_exposition(tp.snapshot()))
    d = profile_delta(before, after)
    assert d["turns.mixed"] == 1 and d["turns.decode"] == 2 and d["turns.prefill"] == 1 and d["turns.other"] == 0
    assert d["prefill_tokens"] == 136 and d["decode_rows"] == 95
    assert d["seconds.plan"] == pytest.approx(0.004) and d["seconds.readback_wait"] == pytest.approx(0.016)
    text = format_profile(d)
    assert text.startswith("4 turns, ") and "plan 1.00 ms" in text and "readback_wait 4.00 ms" in text
    assert "mixed 1, prefill 1, decode 2, other 0" in text
    assert "prefill tokens per turn with prefill 68.0" in text and "decode rows per turn with decode 31.7" in text
    assert format_profile({}) == "no turn profile"
    assert scrape_profile('xlaserve:num_requests_running{model_name="g"} 0.0\n') == {}
