"""Bad requests against a real `kvtierd serve`: each gets its status and changes nothing.

Raw stubs, not the client library, so that malformed fields reach the daemon as sent.
"""

from __future__ import annotations

import grpc
import pytest

from kvtierd.block_hash import Namespace
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from kvtierd.layout import Layout
from kvtierd.token_bytes import pack_token_ids
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.v1 import kvtier_pb2_grpc
from kvtierd.wire.conversions import layout_to_proto

LAYOUT = Layout("m", 2, 2, 16, 4)  # 1 KiB blocks
NS = Namespace(LAYOUT, "")
TOKENS = list(range(100, 132))  # 8 blocks
HASHES = NS.hash_blocks(TOKENS)
MAX_MESSAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("daemon")
    tokens = directory / "tokens"
    tokens.write_text("acme acme-token\nglobex globex-token\n")
    tokens.chmod(0o600)
    args = small_daemon_args(str(directory), t0_bytes="64KiB",
                             extra=["--tokens-file", str(tokens),
                                    "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}"])
    with DaemonProcess(args) as process:
        yield process


@pytest.fixture(scope="module")
def stub(daemon):
    with grpc.insecure_channel(daemon.unix_address) as channel:
        yield kvtier_pb2_grpc.KvTierStub(channel)


ACME = (("authorization", "Bearer acme-token"),)
GLOBEX = (("authorization", "Bearer globex-token"),)


@pytest.fixture(scope="module")
def held(stub):
    """A session of acme holding request "r" (8 hashed blocks + 1 fresh, 4 committed) and "other"."""
    attach = stub.Attach(pb.AttachRequest(layout=layout_to_proto(LAYOUT)), metadata=ACME)
    sid = attach.session_id
    r = stub.Acquire(pb.AcquireRequest(session_id=sid, request_id="r", block_hashes=HASHES, num_extra_blocks=1),
                     metadata=ACME)
    stub.Commit(pb.CommitRequest(session_id=sid, request_id="r", block_ids=r.block_ids[:4], block_hashes=HASHES[:4],
                                 token_ids=pack_token_ids(TOKENS[:16]), parent_hash=attach.root_hash), metadata=ACME)
    other = stub.Acquire(pb.AcquireRequest(session_id=sid, request_id="other", num_extra_blocks=2), metadata=ACME)
    return sid, list(r.block_ids), list(other.block_ids), attach.root_hash


def _state(stub, sid):
    """Everything a bad call must leave as it was: stats, and what the session's requests see."""
    stats = stub.Stats(pb.StatsRequest(), metadata=ACME)
    lookup = stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=HASHES), metadata=ACME)
    return stats.SerializeToString(deterministic=True), lookup.SerializeToString(deterministic=True)


def _bad_calls(stub, sid, r_ids, other_ids, root):
    """(name, call, expected code, text the message must contain)."""
    layout = layout_to_proto(LAYOUT)
    huge = layout_to_proto(Layout("huge", 4096, 64, 128, 16))
    tokens16 = pack_token_ids(TOKENS[:16])
    put_block = dict(block_hash=HASHES[0], token_ids=pack_token_ids(TOKENS[:4]))
    code = grpc.StatusCode
    return [
        ("attach: empty model id", lambda: stub.Attach(pb.AttachRequest(layout=pb.Layout(num_layers=2, num_kv_heads=2,
         head_dim=16, block_size=4)), metadata=ACME), code.INVALID_ARGUMENT, "model_id"),
        ("attach: zero layers", lambda: stub.Attach(pb.AttachRequest(layout=pb.Layout(model_id="m", num_kv_heads=2,
         head_dim=16, block_size=4)), metadata=ACME), code.INVALID_ARGUMENT, "num_layers"),
        ("attach: unknown dtype", lambda: stub.Attach(pb.AttachRequest(layout=pb.Layout(
            model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="int3")), metadata=ACME),
         code.INVALID_ARGUMENT, "dtype"),
        ("attach: tp rank beyond tp size", lambda: stub.Attach(pb.AttachRequest(layout=pb.Layout(
            model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, tp_rank=2, tp_size=2)),
            metadata=ACME), code.INVALID_ARGUMENT, "tp_rank"),
        ("attach: other hash function", lambda: stub.Attach(pb.AttachRequest(layout=layout, hash_algo="xxh3_128"),
                                                           metadata=ACME), code.FAILED_PRECONDITION, "sha256"),
        ("attach: layout whose block exceeds the pool", lambda: stub.Attach(pb.AttachRequest(layout=huge),
                                                                           metadata=ACME),
         code.FAILED_PRECONDITION, "t0_bytes"),
        ("lookup: unknown session", lambda: stub.Lookup(pb.LookupRequest(session_id="nope", block_hashes=HASHES),
                                                       metadata=ACME), code.NOT_FOUND, "unknown"),
        ("lookup: another tenant's session", lambda: stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=HASHES),
                                                                metadata=GLOBEX), code.PERMISSION_DENIED, "tenant"),
        ("lookup: no credential", lambda: stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=HASHES)),
         code.UNAUTHENTICATED, "bearer"),
        ("lookup: unknown token", lambda: stub.Lookup(pb.LookupRequest(session_id=sid), metadata=(
            ("authorization", "Bearer nope"),)), code.UNAUTHENTICATED, "unknown"),
        ("lookup: malformed authorization", lambda: stub.Lookup(pb.LookupRequest(session_id=sid), metadata=(
            ("authorization", "acme-token"),)), code.UNAUTHENTICATED, "Bearer"),
        ("lookup: 5-byte hash", lambda: stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=[b"short"]),
                                                   metadata=ACME), code.INVALID_ARGUMENT, "32 bytes"),
        ("lookup: token ids not u32", lambda: stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=HASHES[:1],
                                                                          token_ids=b"abc"), metadata=ACME),
         code.INVALID_ARGUMENT, "4 bytes"),
        ("lookup: too few tokens for the hashes", lambda: stub.Lookup(pb.LookupRequest(
            session_id=sid, block_hashes=HASHES, token_ids=tokens16), metadata=ACME), code.INVALID_ARGUMENT, "tokens"),
        ("lookup: chain lengths short of the hashes", lambda: stub.Lookup(pb.LookupRequest(
            session_id=sid, block_hashes=HASHES, chain_lengths=[4, 3]), metadata=ACME), code.INVALID_ARGUMENT,
         "chain_lengths"),
        ("lookup: a chain of length 0", lambda: stub.Lookup(pb.LookupRequest(
            session_id=sid, block_hashes=HASHES, chain_lengths=[8, 0]), metadata=ACME), code.INVALID_ARGUMENT,
         "chain_lengths"),
        ("lookup: chains with too few tokens", lambda: stub.Lookup(pb.LookupRequest(
            session_id=sid, block_hashes=HASHES, chain_lengths=[4, 4], token_ids=tokens16), metadata=ACME),
         code.INVALID_ARGUMENT, "tokens"),
        ("acquire: empty request id", lambda: stub.Acquire(pb.AcquireRequest(session_id=sid, block_hashes=HASHES),
                                                          metadata=ACME), code.INVALID_ARGUMENT, "request_id"),
        ("acquire: request id already held", lambda: stub.Acquire(pb.AcquireRequest(
            session_id=sid, request_id="r", block_hashes=HASHES), metadata=ACME), code.FAILED_PRECONDITION, "already"),
        ("acquire: more blocks than the pool", lambda: stub.Acquire(pb.AcquireRequest(
            session_id=sid, request_id="big", num_extra_blocks=100_000), metadata=ACME),
         code.RESOURCE_EXHAUSTED, "device pool full"),
        ("acquire: bad hash among good ones", lambda: stub.Acquire(pb.AcquireRequest(
            session_id=sid, request_id="n", block_hashes=[*HASHES[:2], b"x" * 31]), metadata=ACME),
         code.INVALID_ARGUMENT, "32 bytes"),
        ("acquire: a negative recompute cost", lambda: stub.Acquire(pb.AcquireRequest(
            session_id=sid, request_id="n", block_hashes=HASHES, recompute_s_per_token=-1e-4), metadata=ACME),
         code.INVALID_ARGUMENT, "recompute_s_per_token"),
        ("acquire: a recompute cost that is no number", lambda: stub.Acquire(pb.AcquireRequest(
            session_id=sid, request_id="n", block_hashes=HASHES, recompute_s_per_token=float("nan")), metadata=ACME),
         code.INVALID_ARGUMENT, "recompute_s_per_token"),
        ("commit: foreign block ids", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="r", block_ids=other_ids[:1], block_hashes=HASHES[4:5],
            token_ids=pack_token_ids(TOKENS[16:20]), parent_hash=HASHES[3]), metadata=ACME),
         code.FAILED_PRECONDITION, "not held"),
        ("commit: block id out of range", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="r", block_ids=[10**6], block_hashes=HASHES[4:5],
            token_ids=pack_token_ids(TOKENS[16:20]), parent_hash=HASHES[3]), metadata=ACME),
         code.INVALID_ARGUMENT, "block ids"),
        ("commit: tokens that do not fill the blocks", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="r", block_ids=r_ids[4:6], block_hashes=HASHES[4:6],
            token_ids=pack_token_ids(TOKENS[16:22]), parent_hash=HASHES[3]), metadata=ACME),
         code.INVALID_ARGUMENT, "full blocks"),
        ("commit: first block not under the root", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="other", block_ids=other_ids[:1], block_hashes=HASHES[:1],
            token_ids=pack_token_ids(TOKENS[:4]), parent_hash=HASHES[5]), metadata=ACME),
         code.INVALID_ARGUMENT, "root"),
        ("commit: parent that breaks the chain", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="r", block_ids=r_ids[4:5], block_hashes=HASHES[4:5],
            token_ids=pack_token_ids(TOKENS[16:20]), parent_hash=HASHES[1]), metadata=ACME),
         code.INVALID_ARGUMENT, "parent"),
        ("commit: ids and hashes differ in number", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="r", block_ids=r_ids[4:6], block_hashes=HASHES[4:5],
            token_ids=pack_token_ids(TOKENS[16:20]), parent_hash=HASHES[3]), metadata=ACME),
         code.INVALID_ARGUMENT, "one hash per block"),
        ("commit: a request not held", lambda: stub.Commit(pb.CommitRequest(
            session_id=sid, request_id="ghost", block_ids=r_ids[4:5], block_hashes=HASHES[4:5],
            token_ids=pack_token_ids(TOKENS[16:20]), parent_hash=HASHES[3]), metadata=ACME),
         code.FAILED_PRECONDITION, "not held"),
        ("release: what the session does not hold", lambda: stub.Release(pb.ReleaseRequest(
            session_id=sid, request_id="ghost"), metadata=ACME), code.FAILED_PRECONDITION, "not held"),
        ("fork: onto a live request", lambda: stub.Fork(pb.ForkRequest(
            session_id=sid, request_id="r", child_request_id="other"), metadata=ACME),
         code.FAILED_PRECONDITION, "already"),
        ("append: more blocks than the pool", lambda: stub.AppendBlocks(pb.AppendBlocksRequest(
            session_id=sid, request_id="r", num_blocks=100_000), metadata=ACME), code.RESOURCE_EXHAUSTED, "full"),
        ("prepare write: position out of range", lambda: stub.PrepareWrite(pb.PrepareWriteRequest(
            session_id=sid, request_id="r", position=50), metadata=ACME), code.INVALID_ARGUMENT, "position"),
        ("prepare write: into a committed block", lambda: stub.PrepareWrite(pb.PrepareWriteRequest(
            session_id=sid, request_id="r", position=0), metadata=ACME), code.FAILED_PRECONDITION, "immutable"),
        ("wait: negative timeout", lambda: stub.Wait(pb.WaitRequest(session_id=sid, request_id="other", timeout_s=-1),
                                                    metadata=ACME), code.INVALID_ARGUMENT, "timeout_s"),
        ("put: data of the wrong size", lambda: stub.Put(iter([pb.PutRequest(layout=layout, data=b"x" * 1000,
                                                                             **put_block)]), metadata=ACME),
         code.INVALID_ARGUMENT, "1024 bytes"),
        ("put: second block bad after a good one", lambda: stub.Put(iter([
            pb.PutRequest(layout=layout, data=b"a" * 1024, **put_block),
            pb.PutRequest(block_hash=HASHES[1], token_ids=b"", data=b"b" * 1024)]), metadata=ACME),
         code.INVALID_ARGUMENT, "tokens"),
        ("put: oversized message", lambda: stub.Put(iter([pb.PutRequest(
            layout=layout, data=b"x" * (MAX_MESSAGE_BYTES + 1), **put_block)]), metadata=ACME),
         code.RESOURCE_EXHAUSTED, "larger than max"),
        ("put: no blocks", lambda: stub.Put(iter([]), metadata=ACME), code.INVALID_ARGUMENT, "at least one"),
        ("get: bad hash", lambda: list(stub.Get(pb.GetRequest(layout=layout, block_hashes=[b"zz"]), metadata=ACME)),
         code.INVALID_ARGUMENT, "32 bytes"),
        ("get: invalid layout", lambda: list(stub.Get(pb.GetRequest(layout=pb.Layout(model_id="m")),
                                                      metadata=ACME)), code.INVALID_ARGUMENT, "num_layers"),
    ]


def test_bad_requests_get_their_status_and_change_nothing(stub, held):
    """Each malformed field, wrong layout, foreign block id, release of what is not held,
    unknown or missing credential and oversized message: its status, and no state changed."""
    sid, r_ids, other_ids, root = held
    failures = []
    for name, call, expected, text in _bad_calls(stub, sid, r_ids, other_ids, root):
        before = _state(stub, sid)
        try:
            call()
            got, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            got, details = error.code(), error.details() or ""
        after = _state(stub, sid)
        if got != expected or text not in details or before != after:
            failures.append(f"{name}: got {got.name} {details!r}, want {expected.name} containing {text!r}; "
                            f"state {'changed' if before != after else 'unchanged'}")
    assert not failures, "\n".join(failures)


def test_a_failed_put_stores_nothing(stub, held):
    """A Put stream whose second block is malformed commits neither block."""
    sid = held[0]
    tokens = list(range(5000, 5008))
    hashes = NS.hash_blocks(tokens)
    with pytest.raises(grpc.RpcError) as error:
        stub.Put(iter([pb.PutRequest(layout=layout_to_proto(LAYOUT), block_hash=hashes[0],
                                     token_ids=pack_token_ids(tokens[:4]), data=b"a" * 1024),
                       pb.PutRequest(block_hash=hashes[1], token_ids=pack_token_ids(tokens[4:]), data=b"b")]),
                 metadata=ACME)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lookup = stub.Lookup(pb.LookupRequest(session_id=sid, block_hashes=hashes), metadata=ACME)
    assert lookup.num_hit_blocks == 0
