"""The chat page served at GET /: one self-contained HTML file (static/chat.html), read once at import.

Its Content-Security-Policy lets only the page's own inline script and style run (allowed by their SHA-256, so an
edited page stays allowed without a list kept by hand) and lets it talk only to this server: even model text that
someday slipped into markup could not run script or send the API key elsewhere, and no other site can frame it.
"""
from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from starlette.responses import HTMLResponse

PAGE = (Path(__file__).parent / "static" / "chat.html").read_text(encoding="utf-8")


def _hashes(tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", PAGE, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_hashes('script')}; style-src {_hashes('style')}; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def chat_page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=HEADERS)
