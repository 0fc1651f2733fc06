"""A fault-injecting HTTP proxy in front of an S3 server (the tests' SeaweedFS), for the flaky-storage tests.

Every request is forwarded to the real server, except that on a fixed, seeded schedule some get,
instead of the server's answer, what a busy or failing object store gives:

- ``slowdown``: HTTP 503 with S3's ``SlowDown`` error body (throttling);
- ``error``: HTTP 500 ``InternalError``;
- ``reset``: the connection closed before any answer (a TCP reset / dropped connection); for a
  GET of an object, the headers and half of the body are sent first and then the connection is
  cut (a read broken off mid-body);
- ``slow``: the real answer, after a delay.

`cut()` takes the store off the network until `restore()`: the proxy stops listening (a new
connection is refused: botocore's EndpointConnectionError) and closes every open one on its next
request (a storage outage, as an endpoint that went down).

With `drop_headers` it also forwards every request without those headers (re-signed with the
store's keys, as the signature covers them): a store that ignores conditional writes is SeaweedFS
behind a proxy that drops `If-None-Match` and `If-Match` (`CONDITIONAL_HEADERS`).

The schedule depends only on the seed and the order of requests of each kind (GET of objects,
PUT/POST uploads, other), so a run is reproducible. ``injected`` counts the faults by kind and
operation: a test that ran through the proxy without a fault in some path can see it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

from aiohttp import ClientSession, ClientTimeout, web
from ports import free_port

FAULTS = ("slowdown", "error", "reset", "slow")
CONDITIONAL_HEADERS = ("If-None-Match", "If-Match")
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your '
    b"request rate.</Message></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered an '
    b"internal error. Please try again.</Message></Error>"
)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-encoding", "content-length", "host"}


class FlakyS3Proxy:
    """``FlakyS3Proxy(upstream, rate=0.1, seed=0)``: start() it, point clients at ``url``, stop() it."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float,
        seed: int = 0,
        slow_s: float = 1.0,
        faults: tuple[str, ...] = FAULTS,
        operations: tuple[str, ...] | None = None,
        drop_headers: tuple[str, ...] = (),
        credentials: tuple[str, str] | None = None,
    ):
        """`faults`: the kinds drawn from; `operations`: only these are faulted (None: all);
        `drop_headers`: left out of every forwarded request, which is signed again with
        `credentials` (access key, secret key)."""
        if drop_headers and credentials is None:
            raise ValueError("drop_headers needs the store's credentials to sign the requests again")
        self.drop_headers = {name.lower() for name in drop_headers}
        self.credentials = credentials
        self.dropped: Counter[str] = Counter()  # header -> requests it was taken out of
        self.upstream, self.rate, self.slow_s = upstream.rstrip("/"), rate, slow_s
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}: expected some of {FAULTS}")
        self.faults, self.operations = tuple(faults), operations
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.injected: Counter[tuple[str, str]] = Counter()  # (fault, operation) -> count
        self.requests: Counter[str] = Counter()  # operation -> count
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.down = False  # cut(): every connection refused or closed
        self.refused = 0  # requests that met a cut (on connections open before it)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> FlakyS3Proxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the S3 proxy did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def cut(self) -> None:
        """The store is unreachable from now on: no listening socket, open connections closed."""
        self.down = True
        asyncio.run_coroutine_threadsafe(self._site.stop(), self._loop).result(30)

    def restore(self) -> None:
        """The store is reachable again, on the same address."""

        async def listen() -> None:
            self._site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await self._site.start()

        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(30)
        self.down = False

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._site = web.TCPSite(runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(self._site.start())
        self._session = self._loop.run_until_complete(self._open_session())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._session.close())
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    @staticmethod
    async def _open_session() -> ClientSession:
        return ClientSession(timeout=ClientTimeout(total=300), auto_decompress=False)

    # -- the schedule -----------------------------------------------------------------------------
    @staticmethod
    def operation(request: web.Request) -> str:
        if request.method == "GET" and request.path.count("/") >= 2 and "list-type" not in request.query:
            return "get-object"
        if request.method in ("PUT", "POST"):
            return "upload"
        return "other"  # HEAD, listings, DELETE

    def _draw(self, operation: str) -> str | None:
        with self._lock:
            self.requests[operation] += 1
            if self.operations is not None and operation not in self.operations:
                return None
            if self._rng.random() >= self.rate:
                return None
            fault = self._rng.choice(self.faults)
            self.injected[(fault, operation)] += 1
            return fault

    # -- one request ------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            self.refused += 1
            request.transport.close()  # a connection opened before the cut: dropped, no answer
            return web.Response(status=503)  # never reaches the client
        operation = self.operation(request)
        fault = self._draw(operation)
        body = await request.read()
        if fault == "slowdown":
            return web.Response(status=503, body=_SLOWDOWN, content_type="application/xml")
        if fault == "error":
            return web.Response(status=500, body=_INTERNAL, content_type="application/xml")
        if fault == "reset" and operation != "get-object":
            request.transport.close()  # no answer at all
            return web.Response(status=500)  # never reaches the client
        if fault == "slow":
            await asyncio.sleep(self.slow_s)
        # Host stays the proxy's: the client signed it (a real store checks the signature)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "host" or k.lower() not in _HOP_HEADERS}
        if self.drop_headers and any(k.lower() in self.drop_headers for k in headers):
            headers = self._resigned(request, headers, body)
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as upstream:
            payload = await upstream.read()
            answer = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if fault == "reset" and len(payload) > 1:  # headers and half the body, then the line is cut
            response = web.StreamResponse(status=upstream.status, headers=answer)
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            request.transport.close()
            return response
        if request.method == "HEAD":  # the object's size travels in Content-Length, with no body
            response = web.StreamResponse(status=upstream.status, headers=answer)
            response.content_length = int(upstream.headers.get("Content-Length", 0))
            await response.prepare(request)
            return response
        return web.Response(status=upstream.status, body=payload, headers=answer)

    def _resigned(self, request: web.Request, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """`headers` without `drop_headers`, with a SigV4 signature of what is left."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        for name in [k for k in headers if k.lower() in self.drop_headers]:
            self.dropped[name] += 1
            del headers[name]
        signed = {"authorization", "x-amz-date", "x-amz-content-sha256"}
        kept = {k: v for k, v in headers.items() if k.lower() not in signed}
        unsigned = AWSRequest(request.method, self.upstream + request.path_qs, data=body, headers=kept)
        S3SigV4Auth(Credentials(*self.credentials), "s3", "us-east-1").add_auth(unsigned)
        return dict(unsigned.headers.items())
