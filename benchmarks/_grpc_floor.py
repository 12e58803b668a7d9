"""The floor of bench_daemon_rpc.py: a grpc.aio server that does nothing, set up like the daemon.

    python benchmarks/_grpc_floor.py SOCKET [--max-message-bytes N]

Like `kvtierd serve` (kvtierd/server/serve.py): one uvloop event loop (plain asyncio where uvloop is
missing), `grpc.aio.server` with the same options (max message length both ways, no
SO_REUSEPORT), an insecure port on a unix socket. No interceptor, no servicer, no protobuf: one
generic method, `/floor.Floor/Empty`, takes any bytes and answers empty bytes. What the daemon
takes beyond this per call is what kvtierd adds over grpc.aio itself.

Prints "ready" once serving; SIGTERM or SIGINT stops it (and removes the socket file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

import grpc

SERVICE = "floor.Floor"
METHOD = f"/{SERVICE}/Empty"
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # kvtierd's server.max_message_bytes default


async def _empty(request: bytes, context) -> bytes:
    return b""


async def serve(socket_path: str, max_message_bytes: int) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)])
    handler = grpc.unary_unary_rpc_method_handler(_empty)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Empty": handler})])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server.add_insecure_port("unix:" + socket_path)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(1.0)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="unix socket path to listen on")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    args = parser.parse_args(argv)
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.socket, args.max_message_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
