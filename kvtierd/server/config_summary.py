"""What `kvtierd serve` prints at start-up about its configuration: addresses, sizes, tiers,
policies, auth; never a token or a password."""

from __future__ import annotations

import os

from kvtierd.layout import llama3_8b
from kvtierd.planning.capacity import PoolCapacity
from kvtierd.server.daemon_config import DaemonConfig
from kvtierd.server.ssd_state import no_room_problem, off_by_choice
from kvtierd.t3.remote_config import RemoteConfig, format_endpoints
from kvtierd.tiering.tier_config import PolicyConfig


def config_lines(config: DaemonConfig) -> list[str]:
    """What an operator checks at start-up; never a token."""
    from kvtierd.planning.capacity import format_bytes  # imports torch, which the client must not pay for

    server, pool, ssd, policy = config.server, config.pool, config.ssd, config.policy
    lines = [f"listen: unix {server.socket}"] if server.socket else []
    if server.tcp:
        security = ("TLS, client certificates required" if server.tls_client_ca else "TLS") if server.tls_cert \
            else "INSECURE: no TLS"
        lines.append(f"listen: tcp {server.tcp} ({security})")
    port = "a free port" if server.metrics_port == 0 else f"port {server.metrics_port}"
    lines.append("metrics: off" if server.metrics_port == -1 else f"metrics: {server.metrics_host}, {port}")
    auth = f"bearer tokens from {server.tokens_file}" if server.tokens_file \
        else f"unix peer (socket owner uid {os.getuid()})"
    lines.append(f"auth: {auth}; session lease {server.lease_s:g} s, shutdown grace {server.grace_s:g} s")
    cuda_share = ("by POSIX fd over the fd socket" if pool.cuda_share == "fd" and server.socket
                  else "by cudaIpc handle" + ("" if pool.cuda_share == "ipc" else " (no unix socket, so no fd socket)"))
    lines.append(f"T0 pool: {format_bytes(pool.t0_bytes)} per layout on {pool.device}, "
                 f"up to {pool.max_layouts} layouts, hash {pool.hash_algo}"
                 + (f"; a CUDA pool is shared {cuda_share}" if pool.device != "cpu" else ""))
    host = config.host
    lines.append(f"T1 host: {format_bytes(host.capacity_bytes)} for the node, shared by the layouts as demand goes "
                 f"(each one's fair share: the node's over the layouts attached), codec {host.codec}")
    lines.append(f"T2 ssd: {format_bytes(ssd.capacity_bytes)} for the node in {ssd.directory} (files grow as "
                 f"written, shared by the layouts), codec {ssd.codec}, "
                 f"durability {ssd.durability}{', O_DIRECT' if ssd.o_direct else ''}" if ssd.enabled
                 else f"T2 ssd: OFF: {no_room_problem(config)}" if not off_by_choice(config)
                 else "T2 ssd: off" + (" (ssd.capacity_bytes = 0)" if ssd.directory else ""))
    if ssd.enabled:
        encryption = config.encryption
        lines.append(f"T2 at rest: sealed per tenant (AES-256-GCM), master key {encryption.master_key_file}"
                     if encryption.enabled else "T2 at rest: in the clear ([encryption] off)")
    recompute = ("load a lower-tier hit only when faster than recomputing it, at "
                 + (f"{policy.recompute_s_per_token:g} s/token (policy.recompute_s_per_token)"
                    if policy.recompute_s_per_token > 0 else "the engines' measured cost (every hit until measured)"))
    lines += remote_summary(config.remote, policy)
    if config.remote.enabled:
        remote, max_age_s = config.remote, config.retention.max_age_s
        ttl_ms = remote.value_ttl_ms(max_age_s)
        lines.append(("T3 at rest: sealed per tenant (AES-256-GCM), data keys wrapped by the master key in the store "
                      f"({remote.key_prefix}:tenant-key:*)" if config.encryption.enabled
                      else "T3 at rest: in the clear ([encryption] off)")
                     + (f"; values expire {ttl_ms / 1000:g} s after their write (remote.ttl_s, retention.max_age_s)"
                        if ttl_ms else ""))
    evictions = (policy.t0_eviction, policy.t1_eviction, policy.t2_eviction)
    eviction = "" if evictions == ("lru",) * 3 else "; eviction T0 {}, T1 {}, T2 {}".format(*evictions)
    lines.append(f"policy: T0->T1 {policy.t0_to_t1}, T1->T2 {policy.t1_to_t2}{eviction}; {recompute}")
    lines.append(f"quotas: {len(config.quotas)} tenants" if config.quotas else "quotas: none (unlimited)")
    events = config.events
    media = "GPU, CPU, STORAGE" if events.lower_tiers else "GPU"
    replay = f", replay {events.replay_endpoint}" if events.replay_endpoint else ""
    lines.append(f"kv events: {'connect' if events.connect else 'bind'} {events.zmq_endpoint}{replay}, topic "
                 f"{events.topic!r}, {events.format} format, media {media}, salt {events.salt}"
                 if events.zmq_endpoint else "kv events: off")
    return lines


def remote_summary(remote: RemoteConfig, policy: PolicyConfig) -> list[str]:
    """Start-up lines about T3 (never the password)."""
    if not remote.enabled:
        return ["T3 shared store: off"]
    credential = ("password from " + remote.password_file if remote.password_file else
                  "password set" if remote.password else "no password")
    lines = [f"T3 shared store: {format_endpoints(remote.endpoints)} ({remote.mode}, "
             f"{'TLS' if remote.tls else 'no TLS'}, user {remote.username or 'default'}, {credential}), "
             f"codec {remote.codec}, keys {remote.key_prefix}:*, timeout {remote.timeout_s:g} s, "
             f"breaker {remote.breaker_failures} failures / {remote.breaker_open_s:g} s; "
             f"T1->T3 {policy.t1_to_t3}, T2->T3 {policy.t2_to_t3}"]
    if policy.t0_to_t1 != "write_through" and policy.t1_to_t3 != "off":
        lines.append(f"note: T0->T1 is {policy.t0_to_t1}: a block reaches T3 only once T0 evicts it; set "
                     "policy.t0_to_t1 = write_through for other nodes to see it at once")
    return lines


def planning_lines(config: DaemonConfig, request_tokens: int = 8192) -> list[str]:
    """Capacity lines for a reference layout (Llama-3-8B fp16, block 16); each attached layout
    prints its own when its pool is created."""
    layout = llama3_8b()
    lines = [f"capacity per layout, planned for {layout.model_id} "
             f"({layout.bytes_per_token // 1024} KiB per token, {layout.bytes_per_block // 2**20} MiB per block):"]
    lines += PoolCapacity.from_budget(layout, config.pool.t0_bytes).lines("  T0 device pool", request_tokens)
    if config.host.capacity_bytes:  # a layout's fixed share of the node's budget
        host_share = config.host.capacity_bytes // config.pool.max_layouts
        lines.append(PoolCapacity.from_budget(layout, host_share).lines("  T1 host", request_tokens)[0])
    if config.ssd.enabled:  # alone on the node: all of it
        lines.append(PoolCapacity.from_budget(layout, config.ssd.capacity_bytes).lines(
            "  T2 SSD (alone on the node)", request_tokens)[0])
    return lines
