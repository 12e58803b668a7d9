"""rewrap_shared_keys over records in memory: what opens with the old key is re-wrapped in place (the
data key unchanged), what is under the new key already is counted and left, what opens under
neither is left byte for byte, and a record changed by someone else between read and swap is read
again (and left, counted, when it keeps changing or is gone)."""

from __future__ import annotations

from kvtierd.daemon_key import TenantTag
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.shared_rotation import MAX_ATTEMPTS, SharedRewrap, rewrap_shared_keys
from kvtierd.sealing.tenant_keys import unwrap_key, wrap_key

OLD, NEW, OTHER = MasterKey(b"\x01" * 32), MasterKey(b"\x02" * 32), MasterKey(b"\x03" * 32)


def tag(n: int) -> TenantTag:
    return TenantTag(bytes([n]) * 8)


class Records:
    """RotatableRecords in a dict; `interfere(tag)` runs before each compare-and-set (someone else's write)."""

    def __init__(self, records: dict[TenantTag, bytes], interfere=lambda tag: None) -> None:
        self.records = records
        self.interfere = interfere
        self.num_swaps = 0

    def tags(self):
        return list(self.records)

    def fetch(self, tenant):
        return self.records.get(tenant)

    def replace(self, tenant, expected, record):
        self.interfere(tenant)
        if self.records.get(tenant) != expected:
            return False
        self.records[tenant] = record
        self.num_swaps += 1
        return True


def test_old_keys_are_rewrapped_new_ones_counted_and_foreign_ones_left_as_they_are():
    data = {n: bytes([n]) * 32 for n in range(4)}
    foreign = wrap_key(OTHER, tag(3), data[3])
    records = Records({tag(0): wrap_key(OLD, tag(0), data[0]), tag(1): wrap_key(OLD, tag(1), data[1]),
                       tag(2): wrap_key(NEW, tag(2), data[2]), tag(3): foreign})
    assert rewrap_shared_keys(records, OLD, NEW) == SharedRewrap(2, 1, 1, 0)
    for n in range(3):
        assert unwrap_key(NEW, tag(n), records.records[tag(n)]) == data[n]
        assert unwrap_key(OLD, tag(n), records.records[tag(n)]) is None
    assert records.records[tag(3)] == foreign
    assert rewrap_shared_keys(records, OLD, NEW) == SharedRewrap(0, 3, 1, 0) and records.num_swaps == 2


def test_a_record_changed_between_read_and_swap_is_read_again_and_left_when_it_keeps_changing():
    data = b"\x07" * 32
    changes = {"count": 0}

    def another_node_writes(tenant):  # a fresh old-key wrap each time: the swap never sees what it read
        if tenant == tag(1) or changes["count"] == 0:
            changes["count"] += 1
            records.records[tenant] = wrap_key(OLD, tenant, data)

    records = Records({tag(0): wrap_key(OLD, tag(0), data), tag(1): wrap_key(OLD, tag(1), data)},
                      another_node_writes)
    result = rewrap_shared_keys(records, OLD, NEW)
    assert result == SharedRewrap(1, 0, 0, 1)  # tag 0 on its second try; tag 1 never
    assert unwrap_key(NEW, tag(0), records.records[tag(0)]) == data
    assert unwrap_key(OLD, tag(1), records.records[tag(1)]) == data
    assert changes["count"] == 1 + MAX_ATTEMPTS


def test_a_record_forgotten_meanwhile_is_counted_as_changed_not_recreated():
    records = Records({tag(0): wrap_key(OLD, tag(0), b"\x05" * 32)}, lambda tenant: records.records.pop(tenant))
    assert rewrap_shared_keys(records, OLD, NEW) == SharedRewrap(0, 0, 0, 1) and records.records == {}
