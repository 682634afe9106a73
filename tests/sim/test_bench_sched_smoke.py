"""bench/sched.py's pure parts: workload construction, stream parsing and the figures' math."""

from __future__ import annotations

import math

import orjson

from bench.sched import WORKLOADS, Options, Run, plan
from bench.sched_drive import parse_stream
from bench.sched_stats import Answer, Observed, hit_rate, imbalance, inflight, summarize
from bench.sched_workloads import (
    CHAT,
    QUICK,
    SESSION_HEADER,
    Sizes,
    bursty,
    chat_sessions,
    chat_turn,
    first_messages,
    heterogeneous,
    next_messages,
)
from engines.sim import model


def test_heterogeneous_is_a_steady_stream_of_medium_prompts():
    plan_ = heterogeneous(Sizes(), "salt")
    assert 50 < len(plan_) < 110  # about 8/s for 10 s
    assert [t.at for t in plan_] == sorted(t.at for t in plan_) and plan_[-1].at < 10
    sizes = [len(model.tokenize(t.body["prompt"])) for t in plan_]
    assert all(450 < n < 580 for n in sizes)
    assert len({t.body["prompt"].split()[1] for t in plan_}) == len(plan_)  # no shared prefix
    assert plan_ == heterogeneous(Sizes(), "salt")  # seeded


def test_bursty_mixes_many_short_and_few_long_prompts():
    plan_ = bursty(QUICK, "salt")
    kinds = [t.kind for t in plan_]
    assert kinds.count("short") == 2 * 24 and kinds.count("long") == 2 * 2
    short = [t for t in plan_ if t.kind == "short"]
    long_ = [t for t in plan_ if t.kind == "long"]
    assert max(len(model.tokenize(t.body["prompt"])) for t in short) < 256
    assert min(len(model.tokenize(t.body["prompt"])) for t in long_) > 1000
    assert {round(t.at) for t in plan_} == {0, 2}  # two bursts, 2 s apart


def test_chat_sessions_share_system_prompts_and_grow_turn_by_turn():
    sessions = chat_sessions(Sizes(), "salt")
    assert len(sessions) == 32 and len({s.system for s in sessions}) == 4
    assert len({s.session_id for s in sessions}) == 32
    first = chat_sessions(Sizes(), "other")[0]
    assert first.system != sessions[0].system  # another run shares no cache
    s = sessions[0]
    messages = first_messages(s)
    assert [m["role"] for m in messages] == ["system", "user"]
    grown = next_messages(messages, "an answer", s.user_turns[1])
    assert grown[:2] == messages
    assert grown[2:] == [
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": s.user_turns[1]},
    ]
    req = chat_turn(s, grown, 32)
    assert req.path == CHAT and req.headers == {SESSION_HEADER: s.session_id}
    assert req.body["user"] == s.user and req.body["messages"] == grown
    assert req.body["stream"] is True


def test_imbalance_is_the_busiest_time_average_over_the_mean():
    # engine 0 averages (1 + 4) / 2 = 2.5 over the busy samples, the others 0.5: mean 1.0
    assert imbalance([[1, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]]) == 2.5
    assert imbalance([[1, 0], [0, 1]]) == 1.0  # alternating is an even spread over time
    assert math.isnan(imbalance([[0, 0], []]))


def test_hit_rate_is_a_delta_over_the_run():
    assert hit_rate((100, 1000), (400, 2000)) == 0.3
    assert math.isnan(hit_rate((5, 10), (5, 10)))


def test_inflight_sums_running_and_waiting_over_ranks():
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        ]
    )
    assert inflight(text) == 6.0


def test_summary_percentiles_and_rates():
    answers = [Answer("short", True, t / 1000, 10) for t in range(1, 101)]
    answers.append(Answer("long", False, 0.0, 0))
    obs = Observed(answers, 2.0, (0, 0), (50, 100), [[2, 0]], decode_only=20)
    r = summarize("w", "least-loaded", "prefill", "round-robin", obs)
    assert (r.requests, r.errors) == (101, 1)
    assert r.ttft_p50_ms == 51 and r.ttft_p99_ms == 100  # failed requests have no TTFT
    assert r.output_tps == 500 and r.hit_rate == 0.5 and r.imbalance == 2.0
    assert r.decode_only_share == 20 / 101 and set(r.by_kind) == {"short", "long"}


def test_parse_stream_reads_text_and_usage():
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": " a"}}]},
        {"choices": [{"delta": {"content": " b"}}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    assert parse_stream(raw) == (" a b", 2)
    assert parse_stream(b'data: {"choices": [{"text": " x"}]}\n\ndata: [DONE]\n\n') == (" x", 1)


def test_plan_passes_only_flags_this_pdproxy_has():
    o = Options(
        QUICK,
        ("round-robin", "least-loaded"),
        ("bursty", "bursty-pd256"),
        "round-robin",
        (),
        0.1,
        "",
    )
    runs, skipped = plan(o, "usage: pdproxy [--prefill URL]")
    assert [(r.workload.name, r.policy) for r in runs] == [("bursty", "round-robin")]
    assert runs[0].flags() == [] and len(skipped) == 3
    runs, skipped = plan(o, "[--prefill-policy P] [--decode-policy D] --pd-threshold-tokens N")
    assert len(runs) == 4 and not skipped
    assert runs[0].flags() == ["--prefill-policy", "round-robin", "--decode-policy", "round-robin"]
    pd = next(w for w in WORKLOADS if w.name == "bursty-pd256")
    assert Run(pd, "kv-aware", "least-loaded").flags() == [
        "--pd-threshold-tokens",
        "256",
        "--decode-policy",
        "kv-aware",
        "--prefill-policy",
        "least-loaded",
    ]
