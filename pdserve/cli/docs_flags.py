"""Writes docs/flags.md, the flag reference, from the CLI itself: `pdserve CMD --help` for every
subcommand, rendered at a fixed width so the file is the same on every machine.

    python -m pdserve.cli.docs_flags            # rewrite docs/flags.md
    python -m pdserve.cli.docs_flags --check    # exit 1 if docs/flags.md is stale (tests/test_flags_doc.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

WIDTH = 100
DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
# (section, argv): the servers first, the tools after them
COMMANDS = (
    ("pdserve up", ["up"]),
    ("pdserve prefill", ["prefill"]),
    ("pdserve decode", ["decode"]),
    ("pdserve router", ["router"]),
    ("pdserve admin", ["admin"]),
    ("pdserve admin capacity", ["admin", "capacity"]),
    ("pdserve make-model", ["make-model"]),
    ("pdserve generate", ["generate"]),
)


def help_text(argv: list[str]) -> str:
    from typer.testing import CliRunner

    from .main import app

    result = CliRunner().invoke(
        app,
        [*argv, "--help"],
        prog_name="pdserve",
        terminal_width=WIDTH,
        env={
            "COLUMNS": str(WIDTH),
            "LINES": "50",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "FORCE_COLOR": None,
            "TTY_COMPATIBLE": None,
            "TTY_INTERACTIVE": None,
            "COLORTERM": None,
            "CLICOLOR_FORCE": None,
        },
    )
    if result.exit_code != 0:
        raise RuntimeError(f"pdserve {' '.join(argv)} --help failed:\n{result.output}")
    lines = [line.rstrip() for line in result.output.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def render() -> str:
    parts = [
        "# Flag reference",
        "",
        "Generated from the CLI by `python -m pdserve.cli.docs_flags` (do not edit by hand; a test fails",
        "when this file is stale). Every flag has a default that works on a laptop CPU.",
        "",
    ]
    parts += [f"- [`{title}`](#{title.replace(' ', '-')})" for title, _ in COMMANDS] + [""]
    for title, argv in COMMANDS:
        parts += [f"## {title}", "", "```text", help_text(argv), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv == ["--check"]:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `python -m pdserve.cli.docs_flags`", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    DOC.write_text(text)
    print(DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
