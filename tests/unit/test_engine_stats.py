"""engine_stats: a /metrics page's text -> EngineLoad, and the staleness rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.types import EngineLoad, RankLoad
from pdproxy.wire.engine_stats import (
    STALE_AFTER_INTERVALS,
    fresh_load,
    max_age,
    parse_engine_load,
    relevant_lines,
)

# What the sim serves today: one rank, vLLM's names, HELP/TYPE lines, counters after.
SIM_PAGE = """\
# HELP vllm:num_requests_running Requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="sim-model"} 3.0
# HELP vllm:num_requests_waiting Requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="sim-model"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="sim-model"} 1234.0
"""

# A DP=2 engine: one series per rank (engine="0", engine="1").
MULTI_RANK_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.875
"""

# The shape of a v1-engine vLLM's page (prometheus_client exposition): process and GC
# series first, an info gauge, counters, histograms with buckets, ranks in label order
# model_name then engine, and the deprecated gauge name kept beside the new one.
VLLM_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12873.0
python_gc_objects_collected_total{generation="1"} 3510.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="12",patchlevel="3",version="3.12.3"} 1.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.912848384e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27713"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0625
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0625
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 40960.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-0.6B"} 17.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="Qwen/Qwen3-0.6B"} 15.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 20.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 20.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.5
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-0.6B"} 20.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 20.0
vllm:request_queue_time_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 20.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.012
"""

# vLLM before 0.9 (v0 engine): the old KV gauge name and no engine label.
LEGACY_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 6.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.9
"""

# Only counters and histograms: a metrics page, but not one with the load gauges.
NO_GAUGES_PAGE = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 10.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.5
"""


def test_sim_page_single_rank():
    assert parse_engine_load(SIM_PAGE, 12.5) == EngineLoad(
        running=3.0,
        waiting=1.0,
        kv_usage=0.25,
        scraped_at=12.5,
        ranks=(RankLoad(rank=0, running=3.0, waiting=1.0, kv_usage=0.25),),
    )


def test_multi_rank_sums_queues_and_takes_the_fullest_kv():
    load = parse_engine_load(MULTI_RANK_PAGE, 1.0)
    assert (load.running, load.waiting, load.kv_usage) == (6.0, 5.0, 0.875)
    assert load.ranks == (
        RankLoad(rank=0, running=4.0, waiting=0.0, kv_usage=0.5),
        RankLoad(rank=1, running=2.0, waiting=5.0, kv_usage=0.875),
    )


def test_ranks_are_sorted_numerically():
    page = "\n".join(
        f'vllm:{name}{{engine="{rank}"}} {rank}'
        for rank in (10, 2, 0)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )
    load = parse_engine_load(page, 0.0)
    assert [r.rank for r in load.ranks] == [0, 2, 10]
    assert load.running == 12.0
    assert load.kv_usage == 1.0  # 10 and 2 are clamped to a full cache


def test_real_vllm_page_ignores_everything_but_the_gauges():
    load = parse_engine_load(VLLM_PAGE, 3.0)
    assert (load.running, load.waiting, load.kv_usage) == (7.0, 2.0, 0.0625)
    assert load.ranks == (RankLoad(rank=0, running=7.0, waiting=2.0, kv_usage=0.0625),)


def test_new_kv_name_wins_over_the_deprecated_one():
    page = MULTI_RANK_PAGE + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99\n'
    assert parse_engine_load(page, 0.0).kv_usage == 0.875


def test_legacy_page_without_engine_label():
    load = parse_engine_load(LEGACY_PAGE, 0.0)
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 6.0, 0.9)
    assert load.ranks == ()


def test_duplicate_series_of_one_rank_count_once():
    # several API servers (prometheus multiprocess): one series per pid for the same rank
    page = SIM_PAGE.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.25',
        'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model",pid="1"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model",pid="2"} 0.5',
    )
    load = parse_engine_load(page, 0.0)
    assert load.kv_usage == 0.5
    assert len(load.ranks) == 1


@pytest.mark.parametrize(
    "body",
    [
        "",
        "<html><body><h1>502 Bad Gateway</h1></body></html>",
        '{"object": "error", "message": "Not Found"}',
        "vllm:num_requests_running{engine=0} 1\n",  # unquoted label value
        "vllm:num_requests_running 1.0\nvllm:num_requests_waiting one\n",
        "\x00\x01\x02 binary",
    ],
)
def test_garbage_raises_value_error(body):
    with pytest.raises(ValueError):
        parse_engine_load(body, 0.0)


@pytest.mark.parametrize(
    "body",
    [
        NO_GAUGES_PAGE,
        SIM_PAGE.replace("kv_cache_usage_perc", "something_else"),
        SIM_PAGE.replace("num_requests_waiting", "something_else"),
    ],
)
def test_missing_gauges_raise_value_error(body):
    with pytest.raises(ValueError, match="no vllm:"):
        parse_engine_load(body, 0.0)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("3.0", "NaN"),
        ("3.0", "+Inf"),
        ("3.0", "-1.0"),
        ('engine="0",model_name="sim-model"} 3.0', 'engine="zero",model_name="sim-model"} 3.0'),
    ],
)
def test_nonsense_values_raise_value_error(old, new):
    with pytest.raises(ValueError):
        parse_engine_load(SIM_PAGE.replace(old, new, 1), 0.0)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_text_gives_a_load_or_value_error(body):
    try:
        load = parse_engine_load(body, 0.0)
    except ValueError:
        return
    assert 0.0 <= load.kv_usage <= 1.0


_PIECES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_requests",
        '{engine="0"} 1.0',
        "# TYPE ",
        " gauge",
        "\n",
        "\n\n",
        "\r\n",
        "\u2028",
        "\x85",
        "x",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=30).map("".join))
def test_relevant_lines_are_those_a_line_by_line_test_keeps(text):
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    names += ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    kept = [line for line in text.splitlines() if any(n in line for n in names)]
    assert relevant_lines(text) == "\n".join(kept)


def test_relevant_lines_of_a_vllm_page():
    assert relevant_lines(VLLM_PAGE).splitlines() == [
        line for line in VLLM_PAGE.splitlines() if "_requests_" in line or "cache_usage" in line
    ]


def test_max_age_is_three_intervals_and_zero_when_off():
    assert STALE_AFTER_INTERVALS == 3
    assert max_age(1.0) == 3.0
    assert max_age(0.0) == 0.0


def test_fresh_load_ignores_old_figures():
    load = parse_engine_load(SIM_PAGE, 100.0)
    assert fresh_load(None, 100.0, 3.0) is None
    assert fresh_load(load, 100.0, 3.0) is load
    assert fresh_load(load, 103.0, 3.0) is load  # exactly max_age old: still fresh
    assert fresh_load(load, 103.01, 3.0) is None
    assert fresh_load(load, 100.5, max_age(0.0)) is None  # scraping off: nothing is fresh
