import pytest

from pdproxy.app import create_app
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress

ADDR = (EngineAddress(url="http://a:1"),)


@pytest.mark.parametrize(
    "scheduling",
    [SchedulingConfig(pd_threshold_tokens=256), SchedulingConfig(decode_only_fallback=True)],
)
def test_decode_only_options_need_a_connector_whose_decode_serves_alone(scheduling):
    with pytest.raises(ConfigError, match="p2p-nccl"):
        create_app(
            ProxyConfig(prefill=ADDR, decode=ADDR, kv_connector="p2p-nccl", scheduling=scheduling)
        )
    create_app(ProxyConfig(prefill=ADDR, decode=ADDR, kv_connector="nixl", scheduling=scheduling))
