"""`kvtierd serve` with [encryption] on, as an operator and an attacker see it: a key file others may
read, a malformed key or another master key refuse the start in one line; slot files hold no block
in the clear; `kvtierctl forget` makes a tenant's blocks misses at once and after a restart while
another tenant's are served; a bad forget changes nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvtierd.launch.daemon_process import (
    WRITE_THROUGH,
    DaemonProcess,
    python_module_command,
    small_daemon_args,
    wait_until,
)
from kvtierd.t2.ssd_space import SLOT_FILE_NAME
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.server.test_startup_refusals import assert_refused, serve_until_refused

MASTER_HEX = "5f" * 32
TOKENS = "acme a-token\nglobex g-token\nops o-token\n"


def master_key_file(directory: Path, mode: int = 0o600, content: str = MASTER_HEX + "\n") -> Path:
    path = directory / "master.key"
    path.write_text(content)
    path.chmod(mode)
    return path


def sealed_args(directory: Path, key_file: Path, *extra: str) -> list[str]:
    tokens = directory / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    return small_daemon_args(str(directory), extra=[
        *WRITE_THROUGH, "--tokens-file", str(tokens), "--set", "server.admin_tenants=ops",
        "--set", "encryption.enabled=true", "--set", f"encryption.master_key_file={key_file}", *extra])


def t2_blocks(client: KvtierClient) -> int:
    return sum(t.num_cached_blocks for pool in client.stats().pools for t in pool.tiers if t.tier == "t2")


def put_chain(client: KvtierClient, seed: int) -> tuple[list[bytes], list[int], list[bytes]]:
    """Eight blocks of a prompt of `seed`: their hashes, tokens and bytes (a function of hash and seed)."""
    tokens = prompt(seed, 32)
    hashes = client.attach(LAYOUT, map_pool=False).namespace.hash_blocks(tokens)
    data = [expected_block(bytes([seed]) + h[1:], LAYOUT.bytes_per_block) for h in hashes]
    assert client.put(LAYOUT, [(h, tokens[4 * i:4 * i + 4], d) for i, (h, d) in enumerate(zip(hashes, data))]
                      ).num_blocks == 8
    return hashes, tokens, data


def kvtierctl(address: str, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")} | {"KVTIERD_TOKEN": token}
    return subprocess.run(python_module_command("kvtierd.cli.kvtierctl", "--address", address, *args), env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode, content, names", [
    (0o644, MASTER_HEX, ("encryption.master_key_file", "mode 0644", "chmod 600")),
    (0o640, MASTER_HEX, ("encryption.master_key_file", "mode 0640")),
    (0o600, "not a key", ("encryption.master_key_file", "is not a key")),
], ids=["mode-0644", "mode-0640", "malformed"])
def test_a_key_file_others_may_read_or_without_a_key_refuses_the_start(tmp_path, mode, content, names):
    """Exit 2, one line naming the setting, no trace of the key's content, no key directory made."""
    key_file = master_key_file(tmp_path, mode, content)
    status, stdout, stderr = serve_until_refused(sealed_args(tmp_path, key_file), tmp_path)
    assert_refused(status, stdout, stderr, names)
    assert MASTER_HEX not in stderr
    assert not (tmp_path / "ssd" / "keys").exists()


def kvtierd(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    return subprocess.run(python_module_command("kvtierd.cli.kvtierd_main", *args), env=env, capture_output=True,
                          text=True, timeout=120)


def test_another_master_key_is_refused_until_the_keys_are_rewrapped_to_it(tmp_path):
    """Keys wrapped by master key 1: a start with key 2 is refused naming both ids; `kvtierd
    rewrap-keys` is refused while a daemon runs, then re-wraps them to key 2 without touching a block,
    and a daemon on key 2 serves the blocks sealed before."""
    old_key = master_key_file(tmp_path)
    args = sealed_args(tmp_path, old_key)
    new_key = tmp_path / "new.key"
    new_key.write_text("a0" * 32)
    new_key.chmod(0o600)
    rewrap = ["rewrap-keys", "--ssd-dir", str(tmp_path / "ssd"), "--old-key-file", str(old_key),
              "--new-key-file", str(new_key)]
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address, token="a-token") as client:
        hashes, tokens, data = put_chain(client, 3)
        assert wait_until(lambda: t2_blocks(client) == 8)
        running = kvtierd(*rewrap)
        assert running.returncode == 2 and "in use by another kvtierd" in running.stderr
    slot_files = {p: p.read_bytes() for p in (tmp_path / "ssd").rglob(SLOT_FILE_NAME)}
    new_args = sealed_args(tmp_path, new_key)
    status, stdout, stderr = serve_until_refused(new_args, tmp_path)
    assert_refused(status, stdout, stderr, ("were wrapped by master key", "kvtierd rewrap-keys"))
    done = kvtierd(*rewrap)
    assert done.returncode == 0 and done.stdout.startswith("re-wrapped 1 data key(s)"), done.stderr
    assert {p: p.read_bytes() for p in slot_files} == slot_files  # no block touched
    with DaemonProcess(new_args) as daemon, KvtierClient(daemon.address, token="a-token") as client:
        assert client.get(LAYOUT, hashes, token_ids=tokens) == list(zip(hashes, data))


def test_encryption_without_t2_refuses_the_start_and_with_t3_seals_it(tmp_path):
    """No T2: refused. With a T3 (here a store that is down): the daemon starts and says T3 is sealed."""
    key_file = master_key_file(tmp_path)
    status, stdout, stderr = serve_until_refused(sealed_args(tmp_path, key_file, "--ssd-bytes", "0"), tmp_path)
    assert_refused(status, stdout, stderr, ("encryption.enabled", "needs T2"))
    with DaemonProcess(sealed_args(tmp_path, key_file, "--set", "remote.endpoints=127.0.0.1:1")) as daemon:
        assert "T3 at rest: sealed per tenant (AES-256-GCM)" in daemon.output()
        assert MASTER_HEX not in daemon.output()


def test_forget_makes_a_tenants_blocks_misses_now_and_after_a_restart_and_spares_another(tmp_path):
    """No block is in the slot files in the clear; after `kvtierctl forget --tenant acme` acme's
    blocks are misses and gone from every tier, globex's are served, the same after a restart, and
    acme's next put is served under a new key. The daemon's output never holds the key."""
    key_file = master_key_file(tmp_path)
    args = sealed_args(tmp_path, key_file)
    with DaemonProcess(args) as daemon:
        with KvtierClient(daemon.address, token="a-token") as acme, \
                KvtierClient(daemon.address, token="g-token") as globex:
            acme_hashes, acme_tokens, acme_data = put_chain(acme, 5)
            globex_hashes, globex_tokens, globex_data = put_chain(globex, 6)
            assert wait_until(lambda: t2_blocks(acme) == 16)
            assert [pool.t2_sealed for pool in acme.stats().pools] == [True]
            slot_files = b"".join(p.read_bytes() for p in (tmp_path / "ssd").rglob(SLOT_FILE_NAME))
            assert not any(d[:128] in slot_files for d in acme_data + globex_data)
            done = kvtierctl(daemon.address, "o-token", "forget", "--tenant", "acme")
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("tenant 'acme': data key destroyed; dropped 8 T0, 8 T1, 8 T2 blocks")
            assert acme.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == []
            assert acme.attach(LAYOUT, map_pool=False).lookup(acme_hashes).total.num_blocks == 0
            assert globex.get(LAYOUT, globex_hashes, token_ids=globex_tokens) == list(zip(globex_hashes, globex_data))
            assert t2_blocks(acme) == 8
    assert MASTER_HEX not in daemon.output() and "T2 at rest: sealed per tenant (AES-256-GCM)" in daemon.output()
    with DaemonProcess(args) as daemon:
        with KvtierClient(daemon.address, token="a-token") as acme, \
                KvtierClient(daemon.address, token="g-token") as globex:
            assert acme.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == []
            assert globex.get(LAYOUT, globex_hashes, token_ids=globex_tokens) == list(zip(globex_hashes, globex_data))
            put_chain(acme, 5)
            assert wait_until(lambda: t2_blocks(acme) == 16)
            assert acme.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == list(zip(acme_hashes, acme_data))


def test_a_bad_forget_is_refused_with_its_status_and_changes_nothing(tmp_path):
    """An empty name or '*': INVALID_ARGUMENT (CLI exit 2); a tenant not an admin: PERMISSION_DENIED
    (exit 4); and after each, acme's blocks are all still served."""
    args = sealed_args(tmp_path, master_key_file(tmp_path))
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address, token="a-token") as acme, \
            KvtierClient(daemon.address, token="o-token") as ops:
        hashes, tokens, data = put_chain(acme, 7)
        assert wait_until(lambda: t2_blocks(acme) == 8)
        for name in ("", "*", " acme", "x" * 257):
            with pytest.raises(InvalidArgument, match="forget names one tenant"):
                ops.forget(name)
        with pytest.raises(PermissionDenied, match="forget needs an admin tenant"):
            acme.forget("acme")
        for token, cli_args, status in (("o-token", ["--tenant", "*"], 2), ("a-token", ["--tenant", "globex"], 4),
                                        ("o-token", [], 2)):
            done = kvtierctl(daemon.address, token, "forget", *cli_args)
            assert done.returncode == status and len(done.stderr.splitlines()) == 1, done.stderr
        assert acme.get(LAYOUT, hashes, token_ids=tokens) == list(zip(hashes, data))
        assert t2_blocks(acme) == 8


def test_forget_without_encryption_is_a_failed_precondition(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    args = small_daemon_args(str(tmp_path), extra=["--tokens-file", str(tokens), "--set", "server.admin_tenants=ops"])
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address, token="o-token") as ops:
        with pytest.raises(FailedPrecondition, match=r"forget needs encryption on \(\[encryption\] enabled\)"):
            ops.forget("acme")
