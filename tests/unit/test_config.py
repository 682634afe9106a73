import pytest

from pdproxy.cli.main import parse_config
from pdproxy.config.addresses import parse_engine_url
from pdproxy.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("localhost:8100", "http://localhost:8100"),
        ("http://10.0.0.1:80/", "http://10.0.0.1:80"),
        ("https://engine-1.svc:443", "https://engine-1.svc:443"),
        ("[::1]:8100", "http://[::1]:8100"),
        ("http://[fe80::1]:9", "http://[fe80::1]:9"),
    ],
)
def test_engine_urls(text, url):
    assert parse_engine_url(text) == url


@pytest.mark.parametrize(
    "text",
    ["localhost", "host:0", "host:65536", "ftp://h:1", "h:1/v1", "bad_host:1", "[zz]:1", ":80"],
)
def test_bad_engine_urls(text):
    with pytest.raises(ConfigError):
        parse_engine_url(text)


def test_flags_build_config():
    cfg = parse_config(
        ["--prefill", "a:1", "b:2", "--decode", "c:3", "--port", "9", "--kv-connector", "example"],
        {},
    )
    assert [a.url for a in cfg.prefill] == ["http://a:1", "http://b:2"]
    assert [a.url for a in cfg.decode] == ["http://c:3"]
    assert cfg.port == 9 and cfg.kv_connector == "example"


def test_env_vars_and_flag_precedence():
    env = {
        "PDPROXY_PREFILL": "a:1,b:2",
        "PDPROXY_DECODE": "c:3",
        "PDPROXY_PORT": "7",
        "PDPROXY_ACCESS_LOG": "true",
    }
    cfg = parse_config([], env)
    assert len(cfg.prefill) == 2 and cfg.port == 7 and cfg.access_log is True
    assert parse_config(["--port", "8"], env).port == 8


@pytest.mark.parametrize(
    "argv",
    [
        ["--decode", "c:3"],
        ["--prefill", "a:1"],
        ["--prefill", "nope", "--decode", "c:3"],
        ["--prefill", "a:1", "--decode", "c:3", "--kv-connector", "bogus"],
        ["--prefill", "a:1", "--decode", "c:3", "--keepalive-expiry-secs", "5"],
        ["--prefill", "a:1", "--decode", "c:3", "--port", "x"],
    ],
)
def test_bad_input_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, {})
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_env_exits_2():
    with pytest.raises(SystemExit) as exc:
        parse_config(["--prefill", "a:1", "--decode", "c:3"], {"PDPROXY_PORT": "eighty"})
    assert exc.value.code == 2


def test_prefill_bootstrap_ports():
    cfg = parse_config(["--prefill", "http://p1:8100", "8998", "p2:8100", "--decode", "d:1"], {})
    assert cfg.prefill[0].bootstrap_url == "http://p1:8998"
    assert cfg.prefill[1].bootstrap_url is None


@pytest.mark.parametrize("argv", [["--prefill", "8998", "p:1"], ["--prefill", "p:1", "1", "2"]])
def test_stray_bootstrap_port_exits_2(argv):
    with pytest.raises(SystemExit) as exc:
        parse_config([*argv, "--decode", "d:1"], {})
    assert exc.value.code == 2


def test_registry_makes_static_instances_optional():
    cfg = parse_config(["--registry-port", "36367", "--transfer-mode", "write"], {})
    assert cfg.registry.port == 36367 and cfg.transfer_mode == "WRITE" and cfg.prefill == ()


def test_admin_key_from_env_or_file(tmp_path):
    base = ["--prefill", "p:1", "--decode", "d:1"]
    assert parse_config(base, {}).admin_api_key is None
    assert parse_config(base, {"ADMIN_API_KEY": "k1"}).admin_api_key == "k1"
    key_file = tmp_path / "key"
    key_file.write_text("k2\n")
    assert (
        parse_config(
            [*base, "--admin-api-key-file", str(key_file)], {"ADMIN_API_KEY": "k1"}
        ).admin_api_key
        == "k2"
    )
    assert "k2" not in repr(parse_config([*base, "--admin-api-key-file", str(key_file)], {}))


@pytest.mark.parametrize(
    "extra", [["--admin-api-key-file", "/nonexistent/key"], ["--admin-allow-cidr", "nope"]]
)
def test_bad_admin_config_exits_2(extra):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--prefill", "p:1", "--decode", "d:1", *extra], {})
    assert exc.value.code == 2


def test_fault_tolerance_flags_build_config():
    argv = ["--prefill", "a:1", "--decode", "b:2"]
    argv += ["--retry-max-retries", "4", "--prefill-timeout-secs", "7"]
    argv += ["--decode-header-timeout-secs", "3", "--retry-budget-ratio", "0.5"]
    argv += ["--retry-budget-min-per-sec", "1", "--retry-initial-backoff-ms", "20"]
    argv += ["--retry-max-backoff-ms", "400", "--health-check-interval-secs", "0"]
    argv += ["--health-check-timeout-secs", "1", "--health-failure-threshold", "4"]
    argv += ["--health-success-threshold", "1", "--health-check-endpoint", "/ping"]
    argv += ["--cb-failure-threshold", "5", "--cb-timeout-duration-secs", "2"]
    argv += ["--outlier-max-ejection-secs", "30", "--max-ejection-percent", "25"]
    argv += ["--overload-cooldown-secs", "0"]
    cfg = parse_config(argv, {})
    assert (cfg.retry.max_retries, cfg.retry.budget_ratio, cfg.retry.budget_min_per_sec) == (
        4,
        0.5,
        1,
    )
    assert (cfg.retry.initial_backoff, cfg.retry.max_backoff) == (0.02, 0.4)
    assert (cfg.timeouts.prefill, cfg.timeouts.decode_headers) == (7, 3)
    assert not cfg.health.enabled and cfg.health.endpoint == "/ping"
    assert (cfg.health.timeout, cfg.health.failure_threshold, cfg.health.success_threshold) == (
        1,
        4,
        1,
    )
    o = cfg.outlier
    assert (o.consecutive_failures, o.base_ejection, o.max_ejection) == (5, 2, 30)
    assert (o.max_ejection_percent, o.overload_cooldown) == (25, 0)


def test_fault_tolerance_env_vars():
    env = {"PDPROXY_MAX_RETRIES": "0", "PDPROXY_HEALTH_CHECK_INTERVAL_SECS": "2.5"}
    cfg = parse_config(["--prefill", "a:1", "--decode", "b:2"], env)
    assert cfg.retry.max_retries == 0 and cfg.health.interval == 2.5


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-retries", "-1"],
        ["--health-failure-threshold", "0"],
        ["--health-check-endpoint", "health"],
        ["--outlier-base-ejection-secs", "90"],  # more than the max ejection
        ["--max-ejection-percent", "150"],
        ["--retry-initial-backoff-ms", "2000"],  # more than the max backoff
        ["--prefill-timeout-secs", "0"],
    ],
)
def test_bad_fault_tolerance_flags_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--prefill", "a:1", "--decode", "b:2", *argv], {})
    assert exc.value.code == 2


# -- issue 19: instance addresses on the command line -----------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "a:\u0668\u0660", "--decode", "c:3"],  # Arabic-Indic digits
        ["--prefill", "a:\u00b2", "--decode", "c:3"],
        ["--prefill", "a:1", "\u0668\u0660", "--decode", "c:3"],  # a bootstrap port
        ["--prefill", "0.0.0.0:1", "--decode", "c:3"],
        ["--prefill", "a:1", "--decode", "[::]:3"],
        # pdproxy's own listener, by any literal spelling: a routing loop
        ["--prefill", "a:1", "--decode", "localhost:8000"],
        ["--prefill", "127.0.0.2:8000", "--decode", "c:3"],
        ["--prefill", "a:1", "--decode", "[::1]:8000"],
        ["--port", "9", "--prefill", "a:1", "--decode", "127.1:9"],
        ["--host", "10.0.0.7", "--prefill", "10.0.0.7:8000", "--decode", "c:3"],
    ],
)
def test_bad_instance_addresses_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, {})
    assert exc.value.code == 2


def test_same_port_on_another_host_is_not_a_loop():
    cfg = parse_config(["--prefill", "10.0.0.5:8000", "--decode", "engine:8000"], {})
    assert [a.url for a in cfg.prefill] == ["http://10.0.0.5:8000"]
    cfg = parse_config(["--host", "10.0.0.7", "--prefill", "127.0.0.1:8000", "--decode", "c:3"], {})
    assert cfg.prefill[0].url == "http://127.0.0.1:8000"  # not where pdproxy listens


def test_hop_id_is_random_and_survives_replace():
    import dataclasses

    first = parse_config(["--prefill", "a:1", "--decode", "c:3"], {})
    second = parse_config(["--prefill", "a:1", "--decode", "c:3"], {})
    assert len(first.hop_id) == 16 and first.hop_id != second.hop_id
    assert dataclasses.replace(first, port=9).hop_id == first.hop_id  # --workers' resolved port


def test_kv_events_is_the_default_policy_where_the_fleets_events_are_configured():
    """``--kv-events-endpoint`` turns ``kv-events`` on for both legs unless a policy is
    named (measured better on ``make bench-sched``'s multi-tenant run)."""
    base = ["--prefill", "a:1", "--decode", "c:3"]
    plain = parse_config(base, {}).scheduling
    assert (plain.prefill_policy, plain.decode_policy) == ("prefix-affinity", "least-loaded")
    events = [*base, "--kv-events-endpoint", "tcp://{host}:5557"]
    chosen = parse_config(events, {}).scheduling
    assert (chosen.prefill_policy, chosen.decode_policy) == ("kv-events", "kv-events")
    named = parse_config([*events, "--decode-policy", "least-loaded"], {}).scheduling
    assert (named.prefill_policy, named.decode_policy) == ("kv-events", "least-loaded")
    both = parse_config([*events, "--policy", "round_robin"], {}).scheduling
    assert (both.prefill_policy, both.decode_policy) == ("round-robin", "round-robin")
