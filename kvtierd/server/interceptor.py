"""The one interceptor of the KvTier service: who is calling, which status a failure gets, and
how long each call took.

- Authentication: the tenant of every KvTier call is resolved from its credential before the
  handler runs (tenants.Authenticator) and is available to the handler as `current_tenant()`.
  The health and reflection services are not authenticated (Kubernetes probes carry no token).
- Errors: a kvtierd.errors.KvtierError becomes the status its `code` names, with its message;
  anything else is logged with its traceback and becomes INTERNAL. Handlers never catch.
- Metrics: every call's method, final code and duration go to `observe(method, code, seconds)`.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc.aio import ServicerContext

from kvtierd.errors import KvtierError
from kvtierd.node.tenants import Authenticator, Tenant

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/kvtierd.v1.KvTier/"
_TENANT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("kvtierd_tenant")

# A handler: (request or request iterator, context) -> a response (a coroutine function), or a
# response stream (an async generator). grpc's RpcMethodHandler types them as its sync API's.
Behavior = Callable[..., Any]


def current_tenant() -> Tenant:
    """The tenant of the call being handled (set by the interceptor)."""
    return _TENANT.get()


class StatusInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator,
                 observe: Callable[[str, str, float], None] | None = None) -> None:
        self.authenticator = authenticator
        self.observe = observe
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # method path → its wrapped handler, made once

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method_path = handler_call_details.method
        wrapped = self._wrapped.get(method_path)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None or not method_path.startswith(SERVICE_PREFIX):
            return handler
        method = method_path[len(SERVICE_PREFIX):]
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        elif handler.stream_unary is not None:
            wrapped = grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, method), handler.request_deserializer, handler.response_serializer)
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, method), handler.request_deserializer,
                handler.response_serializer)
        else:
            assert handler.stream_stream is not None, "a method handler has one of the four kinds"
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream, method), handler.request_deserializer,
                handler.response_serializer)
        self._wrapped[method_path] = wrapped
        return wrapped

    def _authenticate(self, context: ServicerContext) -> None:
        _TENANT.set(self.authenticator.tenant(context.invocation_metadata(), context.peer(), context.auth_context))

    def _unary(self, behavior: Behavior, method: str) -> Callable[[Any, ServicerContext], Awaitable[Any]]:
        async def handle(request: Any, context: ServicerContext) -> Any:
            start = time.perf_counter()
            code = "OK"
            try:
                self._authenticate(context)
                return await behavior(request, context)
            except BaseException as error:
                code = code_of(error)
                await _abort(error, code, context, method)
            finally:
                self._observe(method, code, start)
        return handle

    def _streaming(self, behavior: Behavior, method: str) -> Callable[[Any, ServicerContext], AsyncIterator[Any]]:
        async def handle(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            code = "OK"
            try:
                self._authenticate(context)
                async for response in behavior(request, context):
                    yield response
            except BaseException as error:
                code = code_of(error)
                await _abort(error, code, context, method)
            finally:
                self._observe(method, code, start)
        return handle

    def _observe(self, method: str, code: str, start: float) -> None:
        if self.observe is not None:
            self.observe(method, code, time.perf_counter() - start)


def code_of(error: BaseException) -> str:
    """The status name a failure ends its call with."""
    if isinstance(error, KvtierError):
        return error.code
    if type(error).__name__ == "CancelledError":
        return "CANCELLED"
    if _is_abort(error):
        return "ABORTED"
    return "INTERNAL"


async def _abort(error: BaseException, code: str, context: ServicerContext, method: str) -> None:
    """End the call with `code`: our errors with their message, the unexpected as INTERNAL
    (logged with the traceback). Cancellation and grpc's own aborts pass through."""
    if code in ("CANCELLED", "ABORTED") or not isinstance(error, Exception):
        raise error
    if code == "INTERNAL":
        log.error("%s failed", method, exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}: {error}")
    await context.abort(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), str(error))


def _is_abort(error: BaseException) -> bool:
    """context.abort() raises an exception of grpc's own to end the call: let it through."""
    return type(error).__module__.startswith("grpc")
