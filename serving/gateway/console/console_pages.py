"""The console's pages: jinja2 templates and our own scripts and stylesheet (package data under
``templates/`` and ``static/``; nothing is fetched from elsewhere at run time).

    GET  /console                    the overview (charts)
    GET  /console/requests           the request list;  /console/requests/{id}: one request's trace
    GET  /console/keys               keys, tenants and the audit trail
    GET  /console/playground         a chat that streams from /v1/chat/completions
    GET  /console/static/{name}      scripts and the stylesheet
    POST /console/login, /console/logout

Each page, and each static file, needs an admin key like the JSON routes (``console_auth.py``).
A browser without one gets the login page with status 401 (403 for a key that is not an
admin's), which posts the key to ``/console/login`` and keeps it in the tab's sessionStorage for
the playground, which calls ``/v1`` with it.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from fastapi import Depends, FastAPI, Request
from starlette.responses import FileResponse, HTMLResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.console.console_auth import ConsoleAuth, LoginRequest
from serving.gateway.http.errors import OpenAIError

HERE = Path(__file__).parent
STATIC = HERE / "static"
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
PAGES = {"overview": "Overview", "requests": "Requests", "keys": "Keys", "playground": "Playground"}

_templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                autoescape=jinja2.select_autoescape(["html"]))


def render(template: str, status_code: int = 200, **context) -> HTMLResponse:
    """A page from ``templates/`` (autoescaped)."""
    return HTMLResponse(_templates.get_template(template).render(pages=PAGES, **context),
                        status_code=status_code, headers={"Cache-Control": "no-store"})


def install_console_pages(app: FastAPI, auth: ConsoleAuth, models: list[str]) -> None:
    """Adds the pages above to `app`.

    Args:
      auth: the console's admin check.
      models: the served models' names (the playground's choices).
    """

    async def page_admin(request: Request) -> Principal | HTMLResponse:
        try:
            return await auth(request)
        except OpenAIError as e:
            if e.status_code not in (401, 403):
                raise
            return render("login.html", status_code=e.status_code, message=e.message)

    def page(name: str, template: str, **context):
        async def handler(request: Request) -> Response:
            admin = await page_admin(request)
            if isinstance(admin, HTMLResponse):
                return admin
            return render(template, page=name, admin=admin, models=models,
                          **{k: v(request) if callable(v) else v for k, v in context.items()})
        return handler

    app.add_api_route("/console", page("overview", "overview.html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/requests", page("requests", "requests.html"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/console/requests/{request_id}",
                      page("requests", "request.html", request_id=lambda r: r.path_params["request_id"]),
                      methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/keys", page("keys", "keys.html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/playground", page("playground", "playground.html"), methods=["GET"],
                      include_in_schema=False)

    names = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES}

    @app.get("/console/static/{name}", include_in_schema=False)
    async def static(name: str, _: Principal = Depends(auth)) -> Response:
        if name not in names:
            raise OpenAIError(f"No console file {name!r}.", status_code=404, code="not_found")
        return FileResponse(names[name], media_type=MEDIA_TYPES[names[name].suffix],
                            headers={"Cache-Control": "no-cache"})

    @app.post("/console/login", include_in_schema=False)
    async def login(request: Request, body: LoginRequest) -> Response:
        return await auth.login(request, body)

    @app.post("/console/logout", include_in_schema=False)
    async def logout() -> Response:
        return auth.logout()
