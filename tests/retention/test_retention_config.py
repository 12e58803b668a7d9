"""[retention] refuses values that would make hints meaningless, naming the key."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.retention.retention_config import RetentionConfig


def test_the_defaults_are_a_day_and_half_a_tier():
    assert (RetentionConfig().max_ttl_s, RetentionConfig().max_tenant_share) == (86400.0, 0.5)


@pytest.mark.parametrize("fields, key", [
    (dict(max_ttl_s=0), "retention.max_ttl_s"),
    (dict(max_ttl_s=float("inf")), "retention.max_ttl_s"),
    (dict(max_tenant_share=1.5), "retention.max_tenant_share"),
    (dict(max_tenant_share=-0.1), "retention.max_tenant_share"),
])
def test_a_bad_value_names_its_key(fields, key):
    with pytest.raises(InvalidArgument, match=key):
        RetentionConfig(**fields)
