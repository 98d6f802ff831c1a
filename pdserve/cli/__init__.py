"""The `pdserve` command: main.py (the typer app: generate, prefill, decode, router, up, admin),
servers.py, stack.py, admin.py, common.py, check_plan.py (--check-config) and docs_flags.py."""

from .main import app, main  # noqa: F401 (the entry point and the app the tests drive)
