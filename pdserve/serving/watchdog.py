"""The rank watchdog shared by the prefill and decode servers.

A server's ranks run in lock-step: once one dies, the others block in their next collective until
its timeout (minutes). So the server never tries to limp on (nor on a group that broke because its
ranks got out of step, `RankGroup.unhealthy`): a watchdog thread polls the launcher,
and on the first dead rank it says which one, stops every other rank and exits with status 1.
Whatever supervises the server (a shell, docker, Kubernetes) then sees a clear failure at once.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

from .. import env

POLL_S = 0.2
# The watchdog and a server's own failure path can both decide to stop; exactly one does.
_stopping = threading.Lock()


def stop_instance(instance, role: str, message: str) -> NoReturn:
    """Prints `error: <message>; stopping the <role> instance`, stops the ranks, exits with status 1.

    A multi-node instance's leader (runtime/node_group.py) restarts the whole group instead: it stops
    its ranks and the agents' (which then wait for it) and runs itself anew, same command line and
    environment; HTTP is down meanwhile, so /health fails and the router stops choosing it."""
    with _stopping:
        restart = getattr(instance.ranks, "restarts_on_failure", False)
        what = "restarting the whole rank group" if restart else "stopping"
        print(f"error: {message}; {what} the {role} instance", file=sys.stderr, flush=True)
        try:
            instance.shutdown()
            if restart:
                restart_process()
        finally:  # os._exit: the main thread may be inside uvicorn or a rank call; nothing must wait on it
            os._exit(1)


def restart_process() -> NoReturn:
    """Replaces this process by a new run of its own command line (sys.orig_argv). Every socket and
    pipe of this one is close-on-exec, so its ports and the forkserver go with it."""
    count = int(env.GROUP_RESTARTS.number()) + 1
    env.GROUP_RESTARTS.set(str(count))
    print(f"group restart {count}: {' '.join(sys.orig_argv)}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def watch_ranks(instance, role: str, stop: threading.Event, poll_s: float = POLL_S) -> None:
    """Thread body: returns when `stop` is set; never returns if a rank dies or the group breaks."""
    while not stop.wait(poll_s):
        dead = instance.ranks.unhealthy()  # "rank 1 (pid 123) exited with code -9"
        if dead and not stop.is_set():  # set before a clean shutdown stops the ranks on purpose
            stop_instance(instance, role, dead)


def start_watchdog(instance, role: str, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(
        target=watch_ranks, args=(instance, role, stop), name=f"{role}-watchdog", daemon=True
    )
    thread.start()
    return thread


def add_health_route(app, dead_rank, draining=None) -> None:
    """GET /health on a server's FastAPI app: 200 while every rank lives, 503 naming a dead one (or
    why the group broke: `RankGroup.unhealthy`), and 503 {"status": "draining"} once `draining()` is
    true (graceful shutdown: choose another instance)."""
    from fastapi.responses import JSONResponse

    @app.get("/health")
    def health():
        dead = dead_rank()
        if dead:
            return JSONResponse({"status": "unhealthy", "error": dead}, status_code=503)
        if draining is not None and draining():
            return JSONResponse(
                {
                    "status": "draining",
                    "error": "shutting down: running requests are finishing, new ones are refused",
                },
                status_code=503,
            )
        return {"status": "ok"}
