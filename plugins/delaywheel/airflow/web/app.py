"""The dashboard app: an HTML page and a JSON API over `Store.stats()`, behind Airflow's own auth.

The Airflow API server mounts `app` under `URL_PREFIX` (`web/__init__.py`), building it at the first request
(`plugin.DashboardApp`); requests reach it through Airflow's middleware, and
every route depends on `authorized_user`, which resolves the caller exactly as Airflow's core API does
(bearer token or the UI's session cookie) and asks the configured auth manager whether the caller may see
the "DelayWheel" custom view. No credentials: the JSON API answers 401, the page redirects to Airflow's login.
The app serves nothing else: FastAPI's schema and docs pages are off.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.base_auth_manager import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from delaywheel import Store
from delaywheel.lanes import delay_label
from delaywheel.ops.stats import as_json

from .charts import bar_chart, hourly

RESOURCE_NAME = "DelayWheel"  # the custom view auth managers grant (FAB maps it to a permission)
WINDOW = timedelta(minutes=5)  # the lateness window the page shows
REFRESH_S = 15

templates = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))
# No OpenAPI schema and no docs pages: FastAPI serves those outside the routes' dependencies, so they would answer
# anyone, and nothing uses them.
app = FastAPI(
    title="delaywheel",
    description="Delayed-message store: levels, wheel, topics, lateness.",
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)


def authorized_user(user: GetUserDep) -> BaseUser:
    """Airflow's user for this request, if the auth manager lets it read the dashboard (else 403)."""
    if not get_auth_manager().is_authorized_custom_view(method="GET", resource_name=RESOURCE_NAME, user=user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden")
    return user


AuthorizedUser = Annotated[BaseUser, Depends(authorized_user)]


def open_store() -> Store:
    """A store on the `delaywheel_default` connection, one per request (a Store is not thread-safe)."""
    from delaywheel.airflow.hooks import DelayWheelHook  # the hook imports providers: only when serving

    return DelayWheelHook().get_store()


def current_stats() -> dict[str, Any]:
    with open_store() as store:
        return store.stats(window=WINDOW)


@app.exception_handler(HTTPException)
async def login_redirect(request: Request, exc: HTTPException) -> Response:
    """Send a browser without a session to Airflow's login page (and back here after); API clients get the error."""
    if exc.status_code == status.HTTP_401_UNAUTHORIZED and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), status.HTTP_303_SEE_OTHER)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


@app.get("/api/stats")
def api_stats(user: AuthorizedUser) -> Any:
    """The page's numbers as JSON: `now`, `levels`, `wheel` (with `histogram_24h`), `topics`, `retired_unread`,
    `quarantine`, `set_aside`, `window_s`; in the same form as `delaywheel stats --json` (`stats.as_json`)."""
    return as_json({**current_stats(), "window_s": WINDOW.total_seconds()})


@app.get("/", response_class=HTMLResponse)
def page(request: Request, user: AuthorizedUser) -> HTMLResponse:
    """The dashboard, server-rendered; it reloads itself every REFRESH_S seconds."""
    stats = current_stats()
    wheel = stats["wheel"]
    horizons = [
        ("overdue", wheel["overdue"]),
        ("≤ 1 min", wheel["next_minute"]),
        ("≤ 1 h", wheel["next_hour"]),
        ("≤ 24 h", wheel["next_day"]),
        ("later", wheel["later"]),
    ]
    return templates.TemplateResponse(
        request,
        "dashboard.html",
        {
            "stats": stats,
            "user": user.get_name(),
            "window_min": int(WINDOW.total_seconds() // 60),
            "refresh_s": REFRESH_S,
            "api_url": f"{request.scope.get('root_path', '')}/api/stats",
            "horizon_chart": bar_chart(horizons, width=420),
            "histogram_chart": bar_chart(hourly(wheel["histogram_24h"]), width=960),
            "fmt_time": fmt_time,
            "fmt_clock": fmt_clock,
            "fmt_ms": fmt_ms,
            "fmt_delay": fmt_delay,
        },
    )


def fmt_time(value: datetime | None) -> str:
    """UTC to the millisecond: the precision lateness is judged at."""
    return "—" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def fmt_clock(value: datetime | None, now: datetime) -> str:
    """The time of day alone when it falls on the page's UTC day (the full time is in the cell's title), so the
    levels table fits a 1280 px screen; another day's time in full."""
    if value is None or value.astimezone(UTC).date() != now.astimezone(UTC).date():
        return fmt_time(value)
    return value.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def fmt_delay(seconds: float) -> str:
    """A level's delay (seconds, as `Store.stats()` gives it) in the level table's notation: 1s, 30s, 2m, 1h."""
    return delay_label(timedelta(seconds=seconds))


def fmt_ms(seconds: float | None) -> str:
    """A lateness or lag: milliseconds while small (the targets are in ms), seconds or minutes past that."""
    if seconds is None:
        return "—"
    s = float(seconds)
    if abs(s) < 10:
        return f"{s * 1000:,.0f} ms"
    return f"{s:,.1f} s" if abs(s) < 600 else f"{s / 60:,.0f} min"
