"""ServeConfig.check: the server's limits checked once, for the Python API (field names) and for
`deepinfer serve` (its flags, before a model loads: test_engine_core's CLI test)."""

from __future__ import annotations

import pytest
from deepinfer.serve import ServeConfig
from deepinfer.serve.serving_state import ServingState


@pytest.mark.parametrize("fields,message", [
    (dict(served_model_names=[]), "served_model_names must name at least one model"),
    (dict(api_key=""), "api_key must not be empty"),
    (dict(max_queue=-1), "max_queue must be >= 0, got -1"),
    (dict(max_request_bytes=0), "max_request_bytes must be >= 1, got 0"),
    (dict(max_stop_strings=-1), "max_stop_strings must be >= 0, got -1"),
    (dict(stream_interval=0), "stream_interval must be >= 1, got 0"),
    (dict(stream_interval=True), "stream_interval must be an int >= 1, got True"),
    (dict(stream_interval=2.0), "stream_interval must be an int >= 1, got 2.0"),
    (dict(arrival_gap_ms=-0.5), "arrival_gap_ms must be >= 0, got -0.5"),
    (dict(arrival_gap_ms=float("nan")), "arrival_gap_ms must be >= 0, got nan"),
    (dict(tool_call_parser="xml"), "tool_call_parser must be one of auto, hermes, llama3_json, got 'xml'"),
])
def test_a_bad_serve_config_is_refused_before_the_state_is_built(fields, message):
    config = ServeConfig(**{"served_model_names": ["m"], **fields})
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config.check()
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ServingState(None, config)  # fails before it reads the (missing) LLM


def test_the_check_spells_names_as_asked():
    with pytest.raises(ValueError, match="^--max-queue must be >= 0, got -3$"):
        ServeConfig(served_model_names=["m"], max_queue=-3).check(lambda f: "--" + f.replace("_", "-"))


def test_a_good_config_passes():
    ServeConfig(served_model_names=["m"], api_key="k", max_queue=0, max_stop_strings=0, arrival_gap_ms=0.0).check()
