"""docs/flags.md is the CLI's own --help output: it fails here when a flag changes without
`python -m pdserve.cli.docs_flags` being run again."""

from __future__ import annotations

from pdserve.cli import docs_flags


def test_flags_doc_is_current():
    text = docs_flags.render()
    assert docs_flags.DOC.read_text() == text, (
        "docs/flags.md is stale: run `python -m pdserve.cli.docs_flags`"
    )
    for flag in ("--cp-size", "--dcp-size", "--discovery", "--selector", "--check-config", "--prefill-cp"):
        assert flag in text, flag  # the server subcommands' flags are in it


def test_check_mode_catches_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "flags.md"
    stale.write_text(docs_flags.render().replace("--cp-size", "--cp-sise"))
    monkeypatch.setattr(docs_flags, "DOC", stale)
    assert docs_flags.main(["--check"]) == 1
    assert docs_flags.main([]) == 0 and docs_flags.main(["--check"]) == 0  # rewritten: current again
