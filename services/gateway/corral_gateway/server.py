"""The HTTP side: aiohttp routes, corral errors as HTTP statuses, metrics and request logs.

Every answer other than a run's result is JSON too: bad input is a 4xx naming the problem (never
a 500), corral's errors keep their code and message in the body (`error.code`, `error.message`)
next to SandboxFusion's `status`/`message`, and `capacity`/`unavailable` carry Retry-After."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from corral_common import logs, metrics
from corral_common.contract.errors import Code, CorralError

from .languages import LANGUAGES, PayloadTooLarge
from .models import ErrorDetail, ErrorResponse, LanguagesResponse, RunCodeRequest
from .runner import Runner

log = logging.getLogger("corral.gateway")

REQUESTS = metrics.counter("corral_gateway_requests_total", "HTTP requests answered, by route, language and outcome "
                           "(a run's status: Success/Failed, else the HTTP status)", ("route", "language", "outcome"))
SECONDS = metrics.histogram("corral_gateway_request_seconds", "Time to answer an HTTP request", ("route",),
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
OVERHEAD = metrics.histogram("corral_gateway_overhead_seconds", "A run's time in the gateway itself (HTTP parsing, "
                             "translation, encoding), i.e. its answer time minus its time waiting on the bus", (),
                             buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1))
INFLIGHT = metrics.gauge("corral_gateway_inflight", "Runs in progress", ())

STATUS = {
    Code.INVALID_REQUEST: 400,
    Code.FORBIDDEN: 403,
    Code.NOT_FOUND: 404,
    Code.CONFLICT: 409,
    Code.CAPACITY: 429,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.TIMEOUT: 504,
}
MAX_BODY = 16 * 1024 * 1024
_decoder = msgspec.json.Decoder(RunCodeRequest)
_encoder = msgspec.json.Encoder()


@dataclass
class HttpError(Exception):
    status: int
    detail: ErrorDetail


def _error(status: int, code: str, message: str, retry_after_s: float | None = None) -> web.Response:
    body = ErrorResponse(message=message, error=ErrorDetail(code=code, message=message, retry_after_s=retry_after_s))
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else {}
    if status in (429, 503) and not headers:
        headers = {"Retry-After": "1"}
    return web.Response(status=status, body=_encoder.encode(body), content_type="application/json", headers=headers)


def _from_corral(e: CorralError) -> web.Response:
    status = 413 if isinstance(e, PayloadTooLarge) else STATUS.get(e.code, 500)
    return _error(status, e.code.value, e.message, e.retry_after_s)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(obj), content_type="application/json")


class Gateway:
    def __init__(self, runner: Runner):
        self.runner = runner

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        app.router.add_post("/run_code", self.run_code)
        app.router.add_get("/v1/ping", self.ping)
        app.router.add_get("/v1/languages", self.languages)
        app.router.add_post("/run_jupyter", self.run_jupyter)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Any HTTP-level refusal (unknown route, wrong method, body too large) as a JSON error;
        an unexpected exception as a 500 that says what happened (and is logged with its traceback)."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {404: Code.NOT_FOUND, 405: Code.INVALID_REQUEST, 413: Code.INVALID_REQUEST}.get(e.status, Code.INVALID_REQUEST)
            REQUESTS.labels(request.path if e.status != 404 else "unknown", "", str(e.status)).inc()
            return _error(e.status, code.value, f"{request.method} {request.path}: {e.reason}")
        except Exception as e:
            log.exception("request failed", extra={"fields": {"path": request.path}})
            REQUESTS.labels(request.path, "", "500").inc()
            return _error(500, Code.INTERNAL.value, f"internal error in the gateway: {type(e).__name__}: {e}")

    async def ping(self, request: web.Request) -> web.Response:
        return _json("pong")  # what SandboxFusion answers

    async def languages(self, request: web.Request) -> web.Response:
        cfg = self.runner.cfg
        return _json(LanguagesResponse(languages=sorted(LANGUAGES), image=cfg.image, toolchain_image=cfg.toolchain_image))

    async def run_jupyter(self, request: web.Request) -> web.Response:
        REQUESTS.labels("/run_jupyter", "", "501").inc()
        return _error(501, Code.INVALID_REQUEST.value, "/run_jupyter is not provided by corral's gateway (no Jupyter kernel "
                      "in its images); run the cells as one program with /run_code")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def run_code(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        body = await request.read()
        lang = ""
        try:
            try:
                req = _decoder.decode(body)
            except msgspec.ValidationError as e:
                raise HttpError(400, ErrorDetail(code=Code.INVALID_REQUEST.value, message=f"invalid /run_code request: {e}")) from None
            except msgspec.DecodeError as e:
                raise HttpError(400, ErrorDetail(code=Code.INVALID_REQUEST.value, message=f"/run_code needs a JSON object body: {e}")) from None
            lang = req.language if req.language in LANGUAGES else "other"
            INFLIGHT.inc()
            try:
                out = await self.runner.run(req)
            finally:
                INFLIGHT.dec()
        except HttpError as e:
            return self._refused(request, t0, lang, _error(e.status, e.detail.code, e.detail.message))
        except CorralError as e:
            return self._refused(request, t0, lang, _from_corral(e))
        resp = _json(out.response)
        took = time.perf_counter() - t0
        own = max(0.0, took - out.bus_s)
        # the standard Server-Timing header: what the gateway itself took, and the wait on the bus
        resp.headers["Server-Timing"] = f"gateway;dur={own * 1000:.3f}, bus;dur={out.bus_s * 1000:.3f}"
        OVERHEAD.observe(own)
        SECONDS.labels("/run_code").observe(took)
        REQUESTS.labels("/run_code", lang, out.response.status).inc()
        logs.kv(log, logging.INFO, "run", language=lang, status=out.response.status, substrate=out.substrate,
                pod=out.response.executor_pod_name, ms=round(took * 1000, 2), bus_ms=round(out.bus_s * 1000, 2),
                rc=out.response.run_result.return_code if out.response.run_result else None)
        return resp

    def _refused(self, request: web.Request, t0: float, lang: str, resp: web.Response) -> web.Response:
        took = time.perf_counter() - t0
        SECONDS.labels("/run_code").observe(took)
        REQUESTS.labels("/run_code", lang, str(resp.status)).inc()
        logs.kv(log, logging.WARNING if resp.status >= 500 else logging.INFO, "refused", language=lang, http=resp.status,
                body=resp.body.decode()[:500] if isinstance(resp.body, bytes) else "", ms=round(took * 1000, 2))
        return resp
