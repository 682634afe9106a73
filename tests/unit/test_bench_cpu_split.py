"""bench.cpu_split's reading of ``perf report --sort dso``."""

from __future__ import annotations

from collections import Counter

from bench.cpu_split import OTHER, Split, group_of, parse_report

REPORT = """# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 3K of event 'cpu-clock'
#
# Overhead  Shared Object
# ........  ............................................
#
    44.20%  [kernel.kallsyms]
    38.61%  libpython3.11.so.1.0
     7.53%  loop.cpython-311-x86_64-linux-gnu.so
     5.59%  libc.so.6
     2.96%  parser.cpython-311-x86_64-linux-gnu.so
     0.45%  orjson.cpython-311-x86_64-linux-gnu.so
"""


def test_a_report_is_grouped_by_where_the_code_lies():
    groups = parse_report(REPORT)
    assert groups == Counter(
        {
            "kernel": 44.20,
            "python": 38.61,
            "event loop (uvloop)": 7.53,
            "libc": 5.59,
            OTHER: 2.96 + 0.45,
        }
    )
    assert group_of("vllm_router_rs.abi3.so") == "router code"


def test_shares_scale_to_the_cpu_per_request():
    split = Split(cpu_seconds=3.2, requests=640, samples=Counter({"kernel": 44.0, "python": 66.0}))
    assert split.per_request_ms() == 5.0
    assert split.shares() == {"python": 0.6, "kernel": 0.4}
    assert Split().per_request_ms() == 0.0 and Split().shares() == {}
