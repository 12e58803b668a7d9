"""The KV event feed on ZMQ, framed as vLLM's ZmqEventPublisher frames it, so vLLM's subscribers,
llm-d's kv-cache indexer and Dynamo's KV router read a kvtierd node as they read a vLLM engine.

- PUB: one multipart message per batch, `(topic, seq, payload)`: `seq` 8 bytes big-endian, from 0,
  one per batch; `payload` a msgpack KVEventBatch (vllm_events.py). One batch per pool and pump;
  `{model}` in the topic becomes the pool's model id (llm-d reads topics `kv@<pod>@<model>`).
- ROUTER (replay): a request `(identity, b"", start_seq)` (a REQ, or a DEALER sending an empty
  delimiter first) is answered with every buffered batch whose seq >= start_seq,
  `(identity, b"", topic, seq, payload)` each, then `(identity, b"", b"", -1 as 8 signed
  big-endian bytes, b"")`. The last `buffer_steps` batches are kept. Malformed requests are dropped.

Every tenant's blocks are on this feed (it is the node's, for the operator's router; tenants are
told apart by the salt in extra_keys), so it binds loopback or ipc:// only unless allow_remote
(events_config.py). Unlike vLLM, the endpoint is bound unless `connect` is set, whatever its host.

The event loop never waits here: `publish` puts on a bounded queue; one thread encodes, sends and
answers replays, and owns both sockets after `start`. A full queue drops the batch (counted, logged
once); vLLM's protocol cannot say "events lost", so that pool's next batch starts with
AllBlocksCleared: a router forgets the pool's blocks rather than keep a view that is wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import deque

import zmq

from kvtierd.events.vllm_events import MEDIUM_GPU, BatchEncoder, PoolEvents
from kvtierd.index.index_events import AllBlocksCleared

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket again
PUB_HWM = 100_000  # batches ZMQ queues per subscriber before it drops (vLLM's default hwm)


class ZmqEventPublisher:
    def __init__(self, encoder: BatchEncoder, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 buffer_steps: int = 10_000, max_queued_events: int = 100_000, connect: bool = False) -> None:
        self.encoder = encoder
        self.topic = topic
        self.endpoint = endpoint  # the bound address once started (a port of 0 or * resolved)
        self.replay_endpoint = replay_endpoint
        self.connect = connect
        self.max_queued_events = max_queued_events
        self.num_published_batches = 0
        self.num_dropped_events = 0  # the queue was full
        self._queue: queue.SimpleQueue[PoolEvents | None] = queue.SimpleQueue()
        self._num_queued_events = 0  # on the queue now; += on the loop, -= on the thread, under _lock
        self._clear_first: set[str] = set()  # models whose next accepted batch starts with AllBlocksCleared
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)  # (seq, topic, payload)
        self._next_seq = 0
        self._context = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind (or connect) the sockets here, so an address in use fails the daemon's start; from
        then on only the publisher thread touches them."""
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(PUB_HWM)
            if self.connect:
                self._pub.connect(self.endpoint)
            else:
                self.endpoint = _bind(self._pub, self.endpoint)
            if self.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(e.errno, f"{e.strerror} ({self.endpoint}, replay {self.replay_endpoint or 'none'})") from None
        self._thread = threading.Thread(target=self._run, name="kvtierd-zmq-events", daemon=True)
        self._thread.start()

    def publish(self, pool_events: PoolEvents) -> bool:
        """Queue a pool's events for the thread; never blocks. False: dropped (the queue is full)."""
        with self._lock:
            if self._num_queued_events + pool_events.num_events > self.max_queued_events:
                if not self.num_dropped_events:
                    log.warning("KV events dropped: more than %d waiting for the publisher (max_queued_events)",
                                self.max_queued_events)
                self.num_dropped_events += pool_events.num_events
                self._clear_first.add(pool_events.model_id)
                return False
            if pool_events.model_id in self._clear_first:  # the first batch after a drop
                self._clear_first.discard(pool_events.model_id)
                pool_events = dataclasses.replace(pool_events, events_by_medium=(
                    (MEDIUM_GPU, [AllBlocksCleared()]), *pool_events.events_by_medium))
            self._num_queued_events += pool_events.num_events
        self._queue.put(pool_events)
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (for up to `timeout_s`), then close the sockets."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the KV event publisher did not finish within %.1f s", timeout_s)
                return  # the thread still owns the sockets; the process is exiting anyway
        self._close_sockets()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError:
                    log.exception("KV event replay failed")
            try:
                pool_events = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if pool_events is None:
                return
            with self._lock:
                self._num_queued_events -= pool_events.num_events
            try:
                self._send(pool_events)
            except Exception:  # one bad batch must not end the feed
                log.exception("publishing KV events of %s failed", pool_events.model_id)

    def _send(self, pool_events: PoolEvents) -> None:
        payload = self.encoder.encode(pool_events, time.time())
        topic = self.topic.replace("{model}", pool_events.model_id).encode()
        assert self._pub is not None, "bound by start"
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, topic, payload))
        self.num_published_batches += 1

    def _answer_replay(self) -> None:
        replay = self._replay
        assert replay is not None, "bound by start"
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("dropped a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if not self._context.closed:
            self._context.term()


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind; returns the bound endpoint (tcp port 0 or * resolved). An ipc:// socket file is made
    mode 0600, as the daemon's unix socket is: the feed shows every tenant's prefixes."""
    socket.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)
        return endpoint
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)
