"""The web view's routes under ``/ui``: sign-in/out, federations, rounds, runs, uploads, files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response
from fedsplit.server.admin.auth import ADMIN, Principal
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.deps import client_address
from fedsplit.server.admin.errors import (
    AdminError,
    AuthenticationError,
    PermissionDeniedError,
    TooManyRequestsError,
)
from fedsplit.server.admin.security import hash_token
from fedsplit.server.admin.services import downloads, isolation
from fedsplit.server.admin.services.rounds import get_round as get_round_row
from fedsplit.server.admin.ui import activity, rest
from fedsplit.server.admin.ui.baselines import baseline_table
from fedsplit.server.admin.ui.curves import km_chart, primary_metric, privacy_of, run_charts
from fedsplit.server.admin.ui.pages import (
    SECURITY_HEADERS,
    STATIC,
    UIError,
    current_principal,
    render,
    require_admin,
    require_principal,
    same_origin,
    session_store,
    with_headers,
)
from fedsplit.server.admin.ui.runs import FlowerRun
from fedsplit.server.admin.ui.sessions import COOKIE

router = APIRouter(prefix="/ui", include_in_schema=False)

PrincipalDep = Annotated[Principal, Depends(require_principal)]
AdminDep = Annotated[Principal, Depends(require_admin)]
RoundId = Annotated[int, PathParam(ge=1, le=2**62)]
RunId = Annotated[str, PathParam(pattern=r"^[0-9a-f]{12}$")]
RunRound = Annotated[int, PathParam(ge=1, le=10**6)]

STATIC_FILES = {"app.css": "text/css; charset=utf-8", "live.js": "text/javascript; charset=utf-8"}


def _ctx(request: Request) -> AdminContext:
    return request.app.state.admin


def _runs(request: Request, principal: Principal) -> list[FlowerRun]:
    runs = request.app.state.ui.catalog.runs()
    if principal.role == ADMIN:
        return runs
    return [r for r in runs if principal.site_name in r.participants]


def _run(request: Request, principal: Principal, run_id: str) -> FlowerRun:
    run = request.app.state.ui.catalog.get(run_id)
    if run is None or (principal.role != ADMIN and principal.site_name not in run.participants):
        raise UIError(404, f"No Flower run has the id {run_id!r} in the --runs folders "
                           "(it may have been moved).")
    return run


def _visible(principal: Principal) -> set[str] | None:
    return None if principal.role == ADMIN else {str(principal.site_name)}


def _base(principal: Principal, title: str) -> dict[str, object]:
    return {"principal": principal, "admin": principal.role == ADMIN, "title": title,
            "mine": (lambda rows: rows if principal.role == ADMIN
                     else [r for r in rows if r.site == principal.site_name]),
            "round_error": lambda error: isolation.round_error_for(principal, error)}


# Sign-in and sign-out ---------------------------------------------------------------------------
@router.get("/login")
def read_login(request: Request) -> Response:
    """The sign-in form (signed-in browsers go to the overview)."""
    if current_principal(request) is not None:
        return with_headers(RedirectResponse("/ui", status_code=303))
    return render(request, "login.html", {"title": "Sign in", "error": None})


@router.post("/login")
def create_session(request: Request, token: Annotated[str, Form(max_length=1024)] = "") -> Response:
    """Check the token like a bearer token; on success set the session cookie (never the token).

    The browser's previous session, if any, ends (a new id at each sign-in). Failures count
    against the client's address (`ratelimit`): after a few, each further attempt waits longer.
    """
    if not same_origin(request):
        return render(request, "login.html", {"title": "Sign in", "error": "This form must be sent "
                      "from this server's own sign-in page."}, status_code=403)
    ctx = _ctx(request)
    token = token.strip()
    try:
        principal = ctx.check_bearer(token, client_address(request), kind="web view")
    except TooManyRequestsError as e:
        wait = max(1, round(e.retry_after))
        response = render(request, "login.html", {"title": "Sign in", "error": (
            f"Too many failed sign-ins from this address; wait {wait} s before trying again.")},
            status_code=429)
        response.headers["Retry-After"] = str(wait)
        return response
    except AuthenticationError:
        error = ("That token matches no admin and no registered site. Paste the admin token or the "
                 "token `fedsplit admin add-site` printed for your hospital.")
        return render(request, "login.html", {"title": "Sign in", "error": error}, status_code=401)
    sid = session_store(request).create(principal, hash_token(token),
                                        replaces=request.cookies.get(COOKIE))
    ctx.record("signin", principal, client_address(request), channel="web view")
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(COOKIE, sid, httponly=True, samesite="strict", path="/ui",
                        secure=request.url.scheme == "https")
    return with_headers(response)


@router.post("/logout")
def delete_session(request: Request) -> Response:
    """Sign out: end the session and clear the cookie."""
    if not same_origin(request):
        raise UIError(403, "Sign out from this server's own pages; a sign-out sent by another "
                           "site is refused.")
    principal = current_principal(request)
    session_store(request).end(request.cookies.get(COOKIE))
    if principal is not None:
        _ctx(request).record("signout", principal, client_address(request), channel="web view")
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return with_headers(response)


# Pages ------------------------------------------------------------------------------------------
@router.get("")
def read_overview(request: Request, principal: PrincipalDep) -> Response:
    """Every federation: REST rounds, Flower runs, the activity feed and recent uploads."""
    ctx = _ctx(request)
    with ctx.sessions() as session:
        rounds = rest.list_rounds(session, principal, isolation.release_rule(ctx.settings))
        uploads = rest.recent_uploads(session, principal)
    runs = _runs(request, principal)
    events = activity.feed(activity.rest_events(rounds, uploads, principal)
                           + activity.run_events(runs, principal))
    return render(request, "overview.html", {
        **_base(principal, "Federations"), "rounds": rounds, "runs": runs, "events": events,
        "uploads": uploads[:20], "more_uploads": len(uploads) > 20, "primary_metric": primary_metric,
    })


@router.get("/uploads")
def read_uploads(request: Request, principal: PrincipalDep) -> Response:
    """Every recent upload and refusal."""
    with _ctx(request).sessions() as session:
        uploads = rest.recent_uploads(session, principal)
    return render(request, "uploads.html", {**_base(principal, "Uploads"), "uploads": uploads})


@router.get("/rounds/{round_id}")
def read_rest_round(request: Request, principal: PrincipalDep, round_id: RoundId) -> Response:
    """A REST round: every hospital's upload and part in the aggregate, its files, its model."""
    ctx = _ctx(request)
    with ctx.sessions() as session:
        rnd = rest.get_round(session, principal, round_id, isolation.release_rule(ctx.settings))
    if rnd is None:
        raise UIError(404, f"There is no REST round {round_id}.")
    return render(request, "rest_round.html", {**_base(principal, f"REST round {rnd.id}"), "round": rnd})


@router.get("/rounds/{round_id}/model")
async def read_rest_model(request: Request, principal: PrincipalDep, round_id: RoundId,
                          format: str = downloads.FEDSPLIT_FORMAT) -> Response:
    """The round's aggregate, as GET /api/v1/rounds/{id}/model serves it (same minimum)."""
    ctx = _ctx(request)

    def locate() -> tuple[Path, str]:
        with ctx.sessions() as session:
            return downloads.model_file(ctx, get_round_row(session, round_id), format, principal)

    address = client_address(request)
    try:
        path, name = await run_in_threadpool(locate)
    except PermissionDeniedError as e:
        await run_in_threadpool(ctx.record, "model_download_refused", principal, address,
                                round=round_id, file="model", reason=str(e)[:200])
        raise UIError(403, str(e)) from e
    except AdminError as e:
        raise UIError(404, str(e)) from e
    await run_in_threadpool(ctx.record, "model_download", principal, address, round=round_id,
                            file="model", format=format, channel="web view")
    return with_headers(FileResponse(path, media_type="application/x-hdf5", filename=name))


@router.get("/runs/{run_id}")
def read_run(request: Request, principal: PrincipalDep, run_id: RunId) -> Response:
    """A Flower run: its configuration, curves, baselines per hospital, privacy spent, the
    Kaplan-Meier curve (km.json beside it) and every round; or a survival analysis's curve."""
    run = _run(request, principal, run_id)
    visible = _visible(principal)
    metric = primary_metric(run)
    return render(request, "run.html", {
        **_base(principal, f"Run {run.name}"), "run": run, "charts": run_charts(run, visible),
        "privacy": privacy_of(run, visible), "metric": metric,
        "baselines": baseline_table(run.summary, metric, visible), "km_chart": km_chart(run, visible),
    })


@router.get("/runs/{run_id}/rounds/{number}")
def read_run_round(request: Request, principal: PrincipalDep, run_id: RunId, number: RunRound) -> Response:
    """One round of a Flower run: every hospital's status, count, weight and distance."""
    run = _run(request, principal, run_id)
    rnd = run.round(number)
    if rnd is None:
        raise UIError(404, f"Run {run.name!r} has recorded no round {number}.")
    return render(request, "run_round.html", {
        **_base(principal, f"{run.name}: round {number}"), "run": run, "round": rnd,
        "metric": primary_metric(run),
    })


@router.get("/runs/{run_id}/rounds/{number}/model")
def read_run_model(request: Request, principal: AdminDep, run_id: RunId, number: RunRound) -> Response:
    """A Flower round's saved global model (admin only; only files inside the run folder)."""
    run = _run(request, principal, run_id)
    path = run.model_path(number)
    try:
        real = path.resolve(strict=True)
    except OSError:
        raise UIError(404, f"Round {number} of {run.name!r} saved no model.") from None
    if not real.is_relative_to(run.path) or not real.is_file():
        raise UIError(404, f"Round {number} of {run.name!r} saved no model.")
    name = f"{run.name.replace('/', '-')}-round-{number:03d}.h5"
    _ctx(request).record("model_download", principal, client_address(request), run=run.name,
                         round=number, channel="web view")
    return with_headers(FileResponse(real, media_type="application/x-hdf5", filename=name))


@router.get("/static/{name}")
def read_static(name: str) -> Response:
    """The stylesheet and the live-update script (the only assets; nothing from elsewhere)."""
    media = STATIC_FILES.get(name)
    if media is None:
        raise UIError(404, "No such file.")
    response = FileResponse(STATIC / name, media_type=media)
    response.headers.update(SECURITY_HEADERS)
    response.headers["Cache-Control"] = "no-cache"
    return response
