"""VllmExtraConfig: the kv_connector_extra_config keys, read once with the defaults and conversions the
connector applies (numbers through float(), switches through bool()), unknown keys ignored."""

from __future__ import annotations

import pytest

from kvtierd.connectors.vllm.extra_config import VllmExtraConfig
from kvtierd.connectors.vllm.worker import DEFAULT_START_ATTACH_S


def test_no_extra_config_gives_the_documented_defaults():
    for extra in (None, {}):
        config = VllmExtraConfig.from_extra(extra)
        assert (config.address, config.token, config.model_id) == (None, None, None)
        assert (config.lookup_wait_s, config.lookup_ttl_s, config.lookup_timeout_s) == (0.005, 2.0, 1.0)
        assert (config.wait_timeout_s, config.timeout_s, config.retry_after_s) == (30.0, 5.0, 5.0)
        assert config.start_attach_s == DEFAULT_START_ATTACH_S == 10.0
        assert config.async_loads is True and config.prefetch is True


def test_values_are_converted_as_vllm_hands_them_over():
    """JSON numbers or strings become floats; names stay as given; switches go through bool()."""
    config = VllmExtraConfig.from_extra({"address": "unix:///run/k.sock", "token": "t", "model_id": "m",
                                         "timeout_s": "2.5", "retry_after_s": 1, "async_loads": 0, "prefetch": ""})
    assert (config.address, config.token, config.model_id) == ("unix:///run/k.sock", "t", "m")
    assert config.timeout_s == 2.5 and isinstance(config.retry_after_s, float) and config.retry_after_s == 1.0
    assert config.async_loads is False and config.prefetch is False


def test_lookup_timeout_defaults_to_lookup_wait_when_that_is_longer():
    assert VllmExtraConfig.from_extra({"lookup_wait_s": 3}).lookup_timeout_s == 3.0
    assert VllmExtraConfig.from_extra({"lookup_wait_s": 3, "lookup_timeout_s": 0.5}).lookup_timeout_s == 0.5


def test_unknown_keys_are_ignored():
    assert VllmExtraConfig.from_extra({"adress": "x", "kv_buffer_size": 1}) == VllmExtraConfig()


@pytest.mark.parametrize("value", [0, -1, "0"])
def test_a_start_attach_s_that_is_not_positive_is_refused(value):
    with pytest.raises(ValueError, match="start_attach_s must be > 0"):
        VllmExtraConfig.from_extra({"start_attach_s": value})
