"""ValueSealing: a sealed T3 value holds none of its frame in the clear, opens as its own key's only
(block, tenant, layout, codec), and is not made where the tenant has no key this node can use.
The store's records are a dict here (tests/sealing/test_shared_tenant_keys.py's); the real store
is tests/t3/test_sealed_t3.py's."""

from __future__ import annotations

import os

from kvtierd.daemon_key import DaemonKey, TenantTag
from kvtierd.layout import Layout
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys
from kvtierd.t3.block_frame import frame_value, layout_digest, read_frame
from kvtierd.t3.sealed_values import ValueSealing
from kvtierd.token_bytes import pack_token_ids
from tests.sealing.test_shared_tenant_keys import DictRecords

LAYOUT = Layout("m", 2, 2, 16, 4)
ACME, GLOBEX = TenantTag(b"a" * 16), TenantTag(b"g" * 16)
PAYLOAD_NBYTES = 4096


def key_of(tag: TenantTag, n: int) -> DaemonKey:
    return DaemonKey(tag + bytes([n]) * 32)


def frames(tag: TenantTag, count: int = 2):
    """(store key, frame, payload) of `count` blocks of a tenant, each payload random."""
    out = []
    for n in range(count):
        payload = os.urandom(PAYLOAD_NBYTES)
        frame = frame_value(layout_digest(LAYOUT, "raw"), key_of(tag, n + 1), key_of(tag, n),
                            pack_token_ids([1000 + n, 2, 3, 4]), payload)
        out.append((b"k%d" % n, frame, payload))
    return out


def sealing_on(records: DictRecords, master: bytes = b"m" * 32, layout: Layout = LAYOUT,
               codec: str = "raw") -> ValueSealing:
    return ValueSealing(SharedTenantKeys(MasterKey(master), records), layout.fingerprint(), codec)


def opened(sealing: ValueSealing, records: DictRecords, block_hash: DaemonKey, value) -> memoryview | None:
    tag = TenantTag(block_hash[:16])
    opener = sealing.opener([tag], records.read([tag]))
    return sealing.open(opener, block_hash, memoryview(bytes(value)))


def test_a_sealed_value_holds_nothing_of_its_frame_and_opens_to_it_on_another_node():
    records = DictRecords()
    items = frames(ACME)
    sealed = sealing_on(records).seal([(key, frame) for key, frame, _ in items])
    other_node = sealing_on(records)
    for (_, frame, payload), value in zip(items, sealed):
        assert value is not None and len(value) == len(frame) + 28
        stored = bytes(value)
        assert payload[:64] not in stored and frame.head[44:] not in stored  # no bytes, hashes or tokens
        plain = opened(other_node, records, frame.block_hash, stored)
        assert plain is not None and bytes(plain) == bytes(frame)
        assert bytes(read_frame(plain, layout_digest(LAYOUT, "raw"), frame.block_hash, None, PAYLOAD_NBYTES).payload) \
            == payload


def test_a_value_opened_as_another_block_tenant_layout_or_codec_does_not_open():
    records = DictRecords()
    sealing = sealing_on(records)
    (_, first, _), (_, second, _) = frames(ACME)
    value = sealing.seal([(b"k", first)])[0]
    sealing.seal([(b"g", frames(GLOBEX, 1)[0][1])])  # globex has a key too
    assert opened(sealing, records, first.block_hash, value) is not None
    assert opened(sealing, records, second.block_hash, value) is None  # another block of the tenant
    assert opened(sealing, records, key_of(GLOBEX, 1), value) is None  # the same client hash, another tenant
    other_layout = Layout("m", 2, 2, 16, 8)
    assert opened(sealing_on(records, layout=other_layout), records, first.block_hash, value) is None
    assert opened(sealing_on(records, codec="fp8"), records, first.block_hash, value) is None
    flipped = bytearray(bytes(value))
    flipped[40] ^= 1
    assert opened(sealing, records, first.block_hash, flipped) is None


def test_no_value_is_sealed_where_the_tenant_has_no_key_this_node_can_use():
    """Another master key's record: none sealed, the record kept; the store down: none sealed."""
    records = DictRecords()
    sealing_on(records).seal([(b"k", frames(ACME, 1)[0][1])])
    theirs = records.records[ACME]
    assert sealing_on(records, master=b"o" * 32).seal([(b"k", frames(ACME, 1)[0][1])]) == [None]
    assert records.records[ACME] == theirs
    down = DictRecords()
    down.answering = False
    assert sealing_on(down).seal([(b"k", frames(GLOBEX, 1)[0][1])]) == [None]


def test_after_the_record_is_gone_nothing_opens():
    records = DictRecords()
    sealing = sealing_on(records)
    _, frame, _ = frames(ACME, 1)[0]
    value = sealing.seal([(b"k", frame)])[0]
    records.delete(ACME)
    assert opened(sealing, records, frame.block_hash, value) is None
