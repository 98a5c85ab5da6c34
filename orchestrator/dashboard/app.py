"""The FastAPI app: HTML pages rendered on the server, each with its JSON twin under ``/api``.

Read-only: every route is a GET, the storage is opened for reading only, and an
unknown job id, a job id that is not a plain name, or a key that would leave the
storage root answers 404. Texts kept in storage (rank logs, a hung rank's stacks)
are served as plain text. FastAPI's interactive docs are off (they load assets
from a CDN); ``/api`` lists the endpoints instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from spotrun.orchestrator.dashboard import charts, labs, prometheus
from spotrun.orchestrator.dashboard.queries import BadQuery
from spotrun.orchestrator.dashboard.security import guard
from spotrun.orchestrator.dashboard.templating import FILTERS, RESTART_COLUMNS
from spotrun.orchestrator.dashboard.views import Reader
from spotrun.orchestrator.ledger.access import JobNotFound, open_readonly, redact
from spotrun.trainer.storage import Storage, StorageError, UnsafeKeyError

HERE = Path(__file__).resolve().parent
# a range of updates, inclusive: ?from=U0&to=U1 (``from`` is a Python keyword, hence the aliases)
FROM = Query(None, alias="from", description="first update of the range (inclusive)")
TO = Query(None, alias="to", description="last update of the range (inclusive)")
REFRESH_MS = 2000
ATTEMPT_ROWS = 50  # the job page's per-attempt views (timeline, goodput, attempts) show the newest this many
EVENT_ROWS = 200  # the job page lists the newest this many ledger events (the API lists them all)
ENDPOINTS = {
    "/api/jobs": "every job: state, attempts, restarts, updates done of total, last published bundle, time lost",
    "/api/jobs/{job_id}?restart_page=1&bundle_page=1&from=&to=": "the job page: summary, history, timeline, a page "
    "of restarts (with observed replay) and of bundles (newest first, 50 a page), the loss (2,000 points and "
    "each restart's edges)",
    "/api/jobs/{job_id}/history": "exactly what `spotrun history JOB_ID --json` prints",
    "/api/jobs/{job_id}/bundles?verify=false&offset=0&limit=": "bundles, published or orphaned, newest first "
    "(limit rows from offset; none: all); verify=true checks the checksums of those rows",
    "/api/jobs/{job_id}/metrics?name=&from=&to=&points=": "final metric points (one per update) and the writes a "
    "restart replaced; from/to (updates, inclusive) and points (3 to 100,000) cut a range to about that many "
    "points, restart edges and replaced writes kept",
    "/api/jobs/{job_id}/events": "the ledger, event by event (an unparsable file is an event of kind corrupt)",
    "/api/jobs/{job_id}/logs": "the rank logs (what each rank's code wrote) per attempt, with each text's address",
    "/metrics": "Prometheus text format: spotrun_* gauges, one sample per job labelled job=<id>",
    "/api/labs/modular?m=8&a=3&steps=0&predict_at=&predict=": "the modular lab's state and whole history",
    "/api/labs/descent?eta=0.5&x0=2&steps=0&predict_at=&predict=": "the optimization instrument's history",
}


def create_app(storage: Storage | str, *, token: str | None = None, endpoint_url: str | None = None,
               metrics_local_dir: str = "./spotrun-metrics", refresh_ms: int = REFRESH_MS) -> FastAPI:
    """The dashboard over ``storage`` (a URI is opened read-only). ``token``: required on every request.
    ``metrics_local_dir``: where jobs on object storage kept their SQLite/JSONL sinks (the spec's
    ``metrics.local_dir``, relative to this process's working directory)."""
    store = open_readonly(storage, endpoint_url) if isinstance(storage, str) else storage
    reader = Reader(store, metrics_local_dir=metrics_local_dir)
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(FILTERS)
    env.globals.update(storage_uri=redact(store.uri), refresh_ms=refresh_ms, restart_columns=RESTART_COLUMNS,
                       attempt_rows=ATTEMPT_ROWS)

    app = FastAPI(title="spotrun dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.middleware("http")(guard(token))
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.state.reader = reader

    def page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(**context), status_code=status)

    @app.exception_handler(JobNotFound)
    @app.exception_handler(UnsafeKeyError)
    async def not_found(request: Request, exc: Exception) -> HTMLResponse | JSONResponse:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": str(exc)}, status_code=404)
        return page("error.html", 404, title="Not found", message=str(exc))

    @app.exception_handler(BadQuery)
    async def bad_query(request: Request, exc: BadQuery) -> HTMLResponse | JSONResponse:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": str(exc)}, status_code=422)
        return page("error.html", 422, title="Bad request", message=str(exc))

    @app.exception_handler(labs.LabError)
    async def bad_lab(request: Request, exc: labs.LabError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(StorageError)
    async def storage_down(request: Request, exc: StorageError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.get("/", response_class=HTMLResponse)
    def jobs_page() -> HTMLResponse:
        jobs = reader.jobs()
        return page("jobs.html", jobs=jobs, refresh=any(j["state"] == "running" for j in jobs))

    @app.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, restart_page: int = 1, bundle_page: int = 1, lo: int | None = FROM,
                 hi: int | None = TO) -> HTMLResponse:
        job = reader.job(job_id, restart_page, bundle_page, lo, hi)
        goodput = dict(job["history"]["goodput"])
        goodput["attempts"] = goodput["attempts"][-ATTEMPT_ROWS:]
        events_total, events = reader.events_tail(job_id, EVENT_ROWS)
        return page("job.html", job=job, events=events, events_total=events_total,
                    timeline_svg=Markup(charts.timeline(job["timeline"][-ATTEMPT_ROWS:])),
                    loss_svg=Markup(charts.loss_curve(job["loss"])),
                    goodput_svg=Markup(charts.goodput_bars(goodput)),
                    rank_logs=reader.rank_logs(job_id), refresh=job["summary"]["state"] == "running")

    @app.get("/jobs/{job_id}/logs/{attempt}/{name}", response_class=PlainTextResponse)
    def rank_log(job_id: str, attempt: int, name: str) -> PlainTextResponse:
        # plain text, and the guard's nosniff: a line that looks like HTML is shown, never rendered
        return PlainTextResponse(reader.rank_log(job_id, attempt, name))

    @app.get("/jobs/{job_id}/stacks/{attempt}/{rank}", response_class=PlainTextResponse)
    def rank_stacks(job_id: str, attempt: str, rank: str) -> PlainTextResponse:
        # the key is built from the job id and two numbers the reader checks, never from a path sent;
        # plain text and nosniff, like a rank log: a frame's "<module>" is shown, never rendered
        return PlainTextResponse(reader.stacks(job_id, attempt, rank))

    @app.get("/labs", response_class=HTMLResponse)
    def labs_page() -> HTMLResponse:
        return page("labs.html", modular=labs.modular(8, 3, 0), descent=labs.descent(0.5, 2.0, 0), refresh=False)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(prometheus.exposition(reader.scrape), media_type=prometheus.CONTENT_TYPE)

    @app.get("/api")
    def api_index() -> dict[str, str]:
        return ENDPOINTS

    @app.get("/api/jobs")
    def api_jobs() -> list[dict[str, Any]]:
        return reader.jobs()

    @app.get("/api/jobs/{job_id}")
    def api_job(job_id: str, restart_page: int = 1, bundle_page: int = 1, lo: int | None = FROM,
                hi: int | None = TO) -> dict[str, Any]:
        return reader.job(job_id, restart_page, bundle_page, lo, hi)

    @app.get("/api/jobs/{job_id}/history")
    def api_history(job_id: str) -> dict[str, Any]:
        return reader.history(job_id)

    @app.get("/api/jobs/{job_id}/bundles")
    def api_bundles(job_id: str, verify: bool = False, offset: int = 0,
                    limit: int | None = None) -> list[dict[str, Any]]:
        return reader.bundles(job_id, verify=verify, offset=offset, limit=limit)

    @app.get("/api/jobs/{job_id}/metrics")
    def api_metrics(job_id: str, name: str | None = None, lo: int | None = FROM, hi: int | None = TO,
                    points: int | None = None) -> dict[str, Any]:
        return reader.metrics(job_id, name, lo, hi, points)

    @app.get("/api/jobs/{job_id}/events")
    def api_events(job_id: str) -> list[dict[str, Any]]:
        return reader.events(job_id)

    @app.get("/api/jobs/{job_id}/logs")
    def api_logs(job_id: str) -> list[dict[str, Any]]:
        return reader.rank_logs(job_id)

    @app.get("/api/labs/modular")
    def api_modular(m: int = 8, a: int = 3, steps: int = Query(0), predict_at: int | None = None,
                    predict: float | None = None) -> dict[str, Any]:
        return labs.modular(m, a, steps, predict_at, predict)

    @app.get("/api/labs/descent")
    def api_descent(eta: float = 0.5, x0: float = 2.0, steps: int = Query(0), predict_at: int | None = None,
                    predict: float | None = None) -> dict[str, Any]:
        return labs.descent(eta, x0, steps, predict_at, predict)

    return app
