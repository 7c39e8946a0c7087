"""``GET /deepwell/status``: the built-in status page (plain HTML + JS, no build step, no CDN).

The page and its two assets are package data (``gateway/http/static/``, listed under
``[tool.setuptools.package-data]`` in pyproject.toml) served from a fixed list: no path from the
request ever reaches the file system.

Access design: the page itself holds no data and no secret, so it is served without auth. The
data it shows comes from the operator endpoints it fetches, ``GET /v1/deepwell/sessions`` and
``GET /v1/deepwell/stats``, which enforce the admin-key rule themselves. When they answer 401 /
403 the page shows their message and asks for an admin key; the key is kept in the tab's
``sessionStorage`` (gone when the tab closes, never in a URL or a cookie) and sent as an
``Authorization: Bearer`` header, same-origin only. A strict Content-Security-Policy (scripts and
styles from the gateway only, fetches to the gateway only, no framing) keeps anything injected
into the page from running or sending the key elsewhere; the script renders every value as text.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi.responses import Response

from deepwell import logs

log = logs.get_logger("deepwell.gateway.http.status")

PAGE_PATH = "/deepwell/status"
# URL path -> (file under gateway/http/static, media type); the page refers to its assets relatively
ASSETS: dict[str, tuple[str, str]] = {
    PAGE_PATH: ("status.html", "text/html; charset=utf-8"),
    "/deepwell/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/deepwell/status.css": ("status.css", "text/css; charset=utf-8"),
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


class AssetMissing(RuntimeError):
    """The installed package lacks a status-page file (a packaging bug)."""


@cache
def asset_bytes(name: str) -> bytes:
    try:
        return (resources.files("deepwell.gateway.http") / "static" / name).read_bytes()
    except OSError as exc:
        raise AssetMissing(f"status page file gateway/http/static/{name} is missing from the installed "
                           f"package ({exc}); reinstall deepwell") from None


def serve(path: str) -> Response:
    """The asset at ``path`` (a key of ``ASSETS``), with the page's security headers."""
    name, media_type = ASSETS[path]
    try:
        body = asset_bytes(name)
    except AssetMissing as exc:
        log.error("status_page_missing", file=name, error=str(exc))
        return Response(str(exc), status_code=500, media_type="text/plain; charset=utf-8", headers=HEADERS)
    return Response(body, media_type=media_type, headers=HEADERS)
