"""A runner-like client process for the end-to-end tests: `python tests/server/e2e_runner.py ACTION ...`.

Each action attaches to the daemon at KVTIERD_ADDRESS through the client library, maps the
pool, and prints one JSON line with what it saw. Block contents are a fixed function of the
block's hash (`expected_block`), so another process can check bytes it did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from kvtierd.client import KvtierClient
from kvtierd.layout import Layout

LAYOUT = Layout("e2e-model", 2, 2, 16, 4)  # 1 KiB blocks


def expected_block(block_hash: bytes, nbytes: int) -> bytes:
    return hashlib.shake_256(b"kv" + block_hash).digest(nbytes)


def prompt(seed: int, num_tokens: int, shared_tokens: int = 0) -> list[int]:
    """`shared_tokens` common to every seed, then tokens of this seed."""
    own = [(seed * 7919 + i) % 50_000 for i in range(num_tokens - shared_tokens)]
    return [7 + i for i in range(shared_tokens)] + own


def compute(session, request_id: str, tokens: list[int], num_extra_blocks: int = 0) -> dict:
    """What a runner does for one prompt: acquire (hits first), check hit bytes, write and commit
    the rest, keep holding. Returns what it saw."""
    hashes = session.namespace.hash_blocks(tokens)
    acquired = session.acquire(request_id, hashes, num_extra_blocks=num_extra_blocks, token_ids=tokens)
    num_ready = session.wait(request_id) if acquired.pending else acquired.num_t0_hit_blocks
    pool = session.pool
    nbytes = session.bytes_per_block
    bad = sum(pool.read_block(b) != expected_block(h, nbytes) for b, h in zip(acquired.block_ids[:num_ready], hashes))
    for block_id, block_hash in zip(acquired.block_ids[num_ready:len(hashes)], hashes[num_ready:]):
        pool.write_block(block_id, expected_block(block_hash, nbytes))
    if num_ready < len(hashes):
        block_size = session.layout.block_size
        session.commit(request_id, acquired.block_ids[num_ready:len(hashes)], hashes[num_ready:],
                       tokens[num_ready * block_size:len(hashes) * block_size],
                       hashes[num_ready - 1] if num_ready else None)
    return {"num_blocks": len(hashes), "num_hits": num_ready, "num_t0_hits": acquired.num_t0_hit_blocks,
            "num_mismatched": bad, "num_held": len(acquired.block_ids)}


def main(action: str, *args: str) -> None:
    with KvtierClient(token=os.environ.get("KVTIERD_TOKEN")) as client:
        session = client.attach(LAYOUT)
        if action == "compute":  # compute one prompt, release, exit
            seed, num_tokens, shared = map(int, args)
            seen = compute(session, "r", prompt(seed, num_tokens, shared))
            session.release("r")
            print(json.dumps(seen), flush=True)
        elif action == "hold":  # compute prompts and hold them until killed
            num_requests, num_tokens = map(int, args)
            num_held = sum(compute(session, f"r{i}", prompt(i, num_tokens), num_extra_blocks=1)["num_held"]
                           for i in range(num_requests))
            print(json.dumps({"num_held": num_held}), flush=True)
            time.sleep(3600)
        elif action == "load":  # shared-prefix traffic for a bounded time
            worker, duration_s, shared = int(args[0]), float(args[1]), int(args[2])
            deadline = time.monotonic() + duration_s
            num_requests = num_hits = num_mismatched = 0
            while time.monotonic() < deadline:
                request_id = f"w{worker}-{num_requests}"
                seen = compute(session, request_id, prompt(worker * 100_000 + num_requests % 7, shared + 64, shared),
                               num_extra_blocks=1)
                session.release(request_id)
                num_requests += 1
                num_hits += seen["num_hits"]
                num_mismatched += seen["num_mismatched"]
            print(json.dumps({"num_requests": num_requests, "num_hit_blocks": num_hits,
                              "num_mismatched": num_mismatched}), flush=True)
        else:
            raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main(*sys.argv[1:])
