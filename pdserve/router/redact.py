"""What a client may read of an instance-side failure (issue 40 item 7: no topology in error bodies).

The router's failure texts name instances ("prefill http://10.0.0.5:8001: ...") and repeat what an
instance answered, which may name its side channel or its NIXL peers. A client gets the text with
every address replaced by `<instance>` and an error id; the router's log keeps the whole text under
that id, for the operator."""

from __future__ import annotations

import logging
import re

from ..serving.http_edge import new_error_id

log = logging.getLogger("pdserve.router")

_ADDRESS = re.compile(
    r"[a-zA-Z][a-zA-Z0-9+.-]*://(?:\[[^\]\s]*\])?(?:[^\s'\"<>()\[\],]*[^\s'\"<>()\[\],:.;])?"  # URL
    r"|\[[0-9a-zA-Z:.%]+\](?::\d+)?"  # [IPv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|(?<![\w:])[0-9a-fA-F]{0,4}(?::[0-9a-fA-F]{0,4}){2,7}(?![\w:])"  # bare IPv6
    r"|\b[a-zA-Z0-9][a-zA-Z0-9.-]*:\d{1,5}\b"  # host:port
)


MAX_TEXT = 1000  # an instance's error text may be anything: what a client gets of it is cut first


def redact(text: str) -> str:
    """`text` (its first MAX_TEXT characters) with every URL, IP address and host:port replaced by
    `<instance>`."""
    return _ADDRESS.sub("<instance>", text[:MAX_TEXT])


def public(e: BaseException, what: str) -> str:
    """The client's text of failure `e`: redacted, with an error id; the whole text is logged under it."""
    error_id = new_error_id()
    log.warning("%s (error id %s): %s", what, error_id, e)
    return f"{redact(str(e))} (error id {error_id}; the router's log has the details)"
