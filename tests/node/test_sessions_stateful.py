"""Random steps of several sessions of two tenants over one pool — acquire, commit, fork,
append, release, and sessions ending by stream close or lease expiry — with the invariants of
sessions.py checked after each: a request is held iff the index has its table, quotas hold
exactly those tables' bytes, and once every session is gone every block is free and each
reference was released exactly once (the index asserts on a double free)."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.block_hash import Namespace
from kvtierd.errors import ResourceExhausted
from kvtierd.layout import Layout
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.pools import LayoutPool, PoolSettings
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Tenant
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.token_bytes import pack_token_ids
from tests.factories import FakeClock

LAYOUT = Layout("sessions", 1, 1, 8, 4)
NUM_BLOCKS = 24
NAMESPACE = Namespace(LAYOUT, "")
PROMPTS = [list(range(16)), list(range(8)) + [90, 91, 92, 93], list(range(40, 52))]
CHAINS = [NAMESPACE.hash_blocks(p) for p in PROMPTS]
TENANTS = [Tenant.named("acme"), Tenant.named("globex")]
LEASE_S = 5.0
SETTLE_S = 10.0  # bound on waiting for scheduled reclaims


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        settings_ = PoolSettings(PoolConfig(device="cpu", t0_bytes=NUM_BLOCKS * LAYOUT.bytes_per_block),
                                 TierConfig(host_capacity_bytes=0))
        self.pool = LayoutPool(LAYOUT, settings_)
        self.clock = FakeClock()
        self.quotas = QuotaBook()
        self.sessions = SessionTable(LEASE_S, self.quotas, clock=self.clock)
        self.live = []  # sessions not yet ended
        self.request_ids = itertools.count()
        self.num_acquired_refs = 0  # references handed out, by any path
        self.num_released_refs = 0  # references given back by Release

    def teardown(self) -> None:
        self.pool.close()
        self.loop.close()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def on_loop(self, step):
        """Run `step()` on the event loop (reclaims are scheduled there), then wait for them (and
        any task they start) to finish."""
        async def run_and_settle():
            result = step()
            ours = {asyncio.current_task()}

            async def settle():
                ours.add(asyncio.current_task())
                while pending := asyncio.all_tasks() - ours:
                    await asyncio.gather(*pending)

            await asyncio.wait_for(settle(), SETTLE_S)  # a reclaim that never ends fails the step
            return result
        return self.run(run_and_settle())

    def held(self):
        return [(s, r) for s in self.live for r in s.requests]

    # ------------------------------------------------------------------ steps

    @rule(tenant=st.sampled_from(TENANTS))
    def attach(self, tenant):
        session = self.sessions.open(tenant, self.pool)
        self.sessions.stream_opened(session)
        self.live.append(session)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), which=st.integers(0, len(PROMPTS) - 1), num_extra=st.integers(0, 2))
    def acquire(self, data, which, num_extra):
        session = data.draw(st.sampled_from(self.live))
        request_id = f"r{next(self.request_ids)}"
        keys = session.tenant.keys(CHAINS[which])
        try:
            acquired = self.pool.manager.acquire(session.key(request_id), keys, num_extra)
        except ResourceExhausted:
            return
        self.sessions.hold(session, request_id, len(acquired.block_ids))
        self.num_acquired_refs += len(acquired.block_ids)
        n0 = acquired.tier_blocks.t0
        if n0 < len(keys):  # compute and commit the misses, as a runner does
            parent = keys[n0 - 1] if n0 else session.tenant.key(self.pool.client_root)
            self.pool.manager.commit(session.key(request_id), n0, keys[n0:],
                                     pack_token_ids(PROMPTS[which][4 * n0:4 * len(keys)]), parent)

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def fork(self, data):
        session, request_id = data.draw(st.sampled_from(self.held()))
        child = f"r{next(self.request_ids)}"
        block_ids = self.pool.manager.fork(session.key(request_id), session.key(child))
        self.sessions.hold(session, child, len(block_ids))
        self.num_acquired_refs += len(block_ids)

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def append(self, data):
        session, request_id = data.draw(st.sampled_from(self.held()))
        try:
            self.pool.manager.index.append_blocks(session.key(request_id), 1)
        except ResourceExhausted:
            return
        self.sessions.grow(session, request_id, 1)
        self.num_acquired_refs += 1

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def release(self, data):
        session, request_id = data.draw(st.sampled_from(self.held()))
        self.num_released_refs += self.run(self.sessions.release(session, request_id))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def stream_closes(self, data):
        """The client dies: its KeepAlive stream ends and the session is reclaimed."""
        session = data.draw(st.sampled_from(self.live))
        self.live.remove(session)
        self.on_loop(lambda: self.sessions.stream_closed(session))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def lease_runs_out(self, data):
        """A client that never kept its stream open goes quiet past its lease."""
        session = data.draw(st.sampled_from(self.live))
        self.live.remove(session)
        session.num_streams = 0
        self.clock.advance(LEASE_S + 1)
        for other in self.live:  # the others keep calling
            self.sessions.get(other.session_id, other.tenant)
        assert self.on_loop(self.sessions.expire) == 1

    # ------------------------------------------------------------------ invariants

    @invariant()
    def held_requests_are_exactly_the_index_tables(self):
        index_keys = set(self.pool.manager.index.tables)
        assert index_keys == {s.key(r) for s, r in self.held()}
        for session, request_id in self.held():
            table = self.pool.manager.index.tables[session.key(request_id)]
            assert len(table) == session.requests[request_id].num_blocks

    @invariant()
    def quotas_hold_exactly_the_tables(self):
        for tenant in TENANTS:
            num_blocks = sum(s.requests[r].num_blocks for s, r in self.held() if s.tenant == tenant)
            assert self.quotas.held_bytes[tenant.name] == num_blocks * LAYOUT.bytes_per_block

    @invariant()
    def every_reference_is_released_once(self):
        held = sum(s.requests[r].num_blocks for s, r in self.held())
        assert self.num_acquired_refs == self.num_released_refs + self.sessions.num_reclaimed_refs + held
        if not self.live:
            assert self.pool.manager.index.num_free_blocks == NUM_BLOCKS


SessionMachine.TestCase.settings = settings(stateful_step_count=30)
TestSessions = SessionMachine.TestCase
