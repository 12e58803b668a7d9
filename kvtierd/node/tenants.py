"""Tenants: who a caller is, taken from its credential, and the key prefix that isolates it.

A client hashes its blocks with tenant "" (kvtierd.block_hash.Namespace(layout, "")); the
daemon never trusts a client to name its tenant. It prefixes every key with the caller's
`Tenant.tag`, a fixed digest of the tenant's name, so the daemon's key of a block is
`tag (16 bytes) + client hash`, a `DaemonKey`. Another tenant's cached prefix therefore has other keys: it is
a plain dictionary miss, on the same code path as any miss (design §4). The key's layout and its
pack/unpack helpers are kvtierd/daemon_key.py's.

Where the tenant comes from, first match wins:
1. a bearer token (`authorization: Bearer <token>` metadata), when a tokens file is
   configured; then every call must carry a known token;
2. the common name of a verified TLS client certificate (TCP with client certificates);
3. the unix socket's owner: the socket is mode 0600, so only its owner (and root) can connect.
   gRPC Python does not expose SO_PEERCRED of a connection (grpc/grpc#15511, #28755), so the
   daemon cannot tell two uids apart on one socket; the file mode decides who may connect.
Token values are never logged: the book keeps their sha256 digests only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping

from kvtierd.daemon_key import TAG_BYTES, DaemonKey, TenantTag, make_daemon_key, make_daemon_keys
from kvtierd.errors import InvalidArgument, Unauthenticated

log = logging.getLogger(__name__)

_TAG_DOMAIN = b"kvtierd-tenant\x00"


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant and the prefix of every key it owns. `tag` is a fixed function of `name`."""

    name: str
    tag: TenantTag

    @classmethod
    def named(cls, name: str) -> Tenant:
        return cls(name, TenantTag(hashlib.sha256(_TAG_DOMAIN + name.encode()).digest()[:TAG_BYTES]))

    def key(self, client_hash: bytes) -> DaemonKey:
        return make_daemon_key(self.tag, client_hash)

    def keys(self, client_hashes: Iterable[bytes]) -> list[DaemonKey]:
        return make_daemon_keys(self.tag, client_hashes)


class TokenBook:
    """Bearer token → tenant, from a file of `tenant token` lines ('#' starts a comment)."""

    def __init__(self, tenant_by_digest: dict[bytes, Tenant], path: str = "") -> None:
        self._tenant_by_digest = tenant_by_digest
        self.path = path

    @classmethod
    def load(cls, path: str) -> TokenBook:
        try:
            with open(path, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                lines = f.read().splitlines()
        except OSError as e:
            raise InvalidArgument(f"tokens file {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("tokens file %s is readable by group or others (mode %o): chmod 600 it", path, mode & 0o777)
        tenant_by_digest: dict[bytes, Tenant] = {}
        for number, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            fields = text.split()
            if len(fields) != 2:
                raise InvalidArgument(f"tokens file {path}, line {number}: expected 'tenant token'")
            name, token = fields
            digest = hashlib.sha256(token.encode()).digest()
            if digest in tenant_by_digest:
                raise InvalidArgument(f"tokens file {path}, line {number}: this token is already given to a tenant")
            tenant_by_digest[digest] = Tenant.named(name)
        if not tenant_by_digest:
            raise InvalidArgument(f"tokens file {path} names no token")
        return cls(tenant_by_digest, path)

    @property
    def num_tokens(self) -> int:
        return len(self._tenant_by_digest)

    def tenant_names(self) -> list[str]:
        return sorted({tenant.name for tenant in self._tenant_by_digest.values()})

    def tenant_of(self, token: str) -> Tenant:
        tenant = self._tenant_by_digest.get(hashlib.sha256(token.encode()).digest())
        if tenant is None:
            raise Unauthenticated("unknown bearer token")
        return tenant


class Authenticator:
    """Resolves the tenant of a call from its metadata, TLS peer and transport."""

    def __init__(self, tokens: TokenBook | None, socket_owner_uid: int = os.getuid()) -> None:
        self.tokens = tokens
        self.socket_tenant = Tenant.named(f"uid:{socket_owner_uid}")

    def describe(self) -> str:
        if self.tokens is not None:
            return f"bearer tokens from {self.tokens.path} ({self.tokens.num_tokens} tokens)"
        return f"unix peer: the socket owner ({self.socket_tenant.name}); TCP: TLS client certificate"

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None, peer: str,
               auth_context: Callable[[], Mapping[str, Iterable[bytes]]]) -> Tenant:
        """The caller's tenant; `auth_context()` (the TLS peer's properties) is read only for TCP."""
        if self.tokens is not None:
            for key, value in metadata or ():
                if key == "authorization" and isinstance(value, str):  # a str: its key does not end in -bin
                    scheme, _, token = value.partition(" ")
                    if scheme.lower() != "bearer" or not token:
                        raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
                    return self.tokens.tenant_of(token.strip())
            raise Unauthenticated("this daemon requires a bearer token (authorization: Bearer <token>)")
        if peer.startswith("unix:"):
            return self.socket_tenant
        names = auth_context().get("x509_common_name")
        if names:
            return Tenant.named(next(iter(names)).decode())
        raise Unauthenticated("no credential: TCP callers need a bearer token or a TLS client certificate")
