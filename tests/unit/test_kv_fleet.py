"""Where each engine rank's KV events are: the endpoint template, filled per instance."""

import pytest

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.errors import ConfigError
from pdproxy.membership.kv_fleet import endpoint_for


@pytest.mark.parametrize(
    ("template", "url", "rank", "expected"),
    [
        ("tcp://{host}:5557", "http://10.0.0.7:8000", 0, "tcp://10.0.0.7:5557"),
        ("tcp://{host}:5557", "http://10.0.0.7:8000", 3, "tcp://10.0.0.7:5560"),  # as vLLM
        ("tcp://{host}:{dp_rank}7", "http://e:8000", 2, "tcp://e:27"),
        ("ipc:///run/{port}.events", "http://e:8000", 0, "ipc:///run/8000.events"),
        ("ipc:///run/{port}.events", "http://e:8000", 1, "ipc:///run/8000.events_dp1"),
        ("tcp://{host}:5557", "http://[::1]:8000", 0, "tcp://[::1]:5557"),
    ],
)
def test_the_template_is_filled_per_instance_and_rank(template, url, rank, expected):
    assert endpoint_for(template, url, rank) == expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"kv_events_endpoint": "http://x:1"}, "tcp:// or ipc://"),
        ({"kv_events_endpoint": "tcp://{hostname}:1"}, "only the bare fields {host}"),
        ({"kv_events_replay_endpoint": "tcp://{host}:5558"}, "needs --kv-events-endpoint"),
    ],
)
def test_bad_endpoints_are_refused_at_start(flags, message):
    with pytest.raises(ConfigError, match=message):
        SchedulingConfig(**flags)
