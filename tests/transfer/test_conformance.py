"""The hand-off protocols (transfer/interfaces.py, transfer/rank_commands.py) and everything that
implements them -- the servers' classes and the tests' fakes -- have the same signatures: every
method the protocol names, with the protocol's parameters in its order, names, kinds and defaults
(extra parameters only with defaults), and every attribute it declares. So production never
branches on a fake's narrower signature, and a fake cannot drift from what the servers do."""

from __future__ import annotations

import inspect
import re

import pytest

from pdserve.decode_server.destination import DriverDestination
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.transfer.interfaces import KVDestination, KVSource
from pdserve.transfer.nixl import NixlReceiver
from pdserve.transfer.rank_commands import Receiver
from pdserve.transfer.tcp import TcpReceiver
from tests.transfer.fakes import FakeDestination, FakeSource
from tests.transfer.handoff_driver import FaultySource

IMPLEMENTATIONS = {
    KVSource: [PrefillInstance, FakeSource, FaultySource],
    KVDestination: [DriverDestination, FakeDestination],
    Receiver: [TcpReceiver, NixlReceiver],
}
CASES = [(proto, impl) for proto, impls in IMPLEMENTATIONS.items() for impl in impls]


def _methods(proto) -> list[str]:
    return [name for name, v in vars(proto).items() if inspect.isfunction(v) and not name.startswith("_")]


def _attributes(proto) -> list[str]:
    return [name for name in vars(proto).get("__annotations__", {}) if not name.startswith("_")]


def _has_attribute(impl, name: str) -> bool:
    """A class attribute, a dataclass field, or one that __init__ assigns (`self.name =` or `: ...`)."""
    if name in getattr(impl, "__dataclass_fields__", {}) or hasattr(impl, name):
        return True
    init = inspect.getsource(impl.__init__) if "__init__" in vars(impl) else ""
    return re.search(rf"self\.{name}\b[^=\n]*=", init) is not None


def signature_problems(proto, impl) -> list[str]:
    """What `impl` lacks or does differently from `proto` (empty: it conforms)."""
    problems = [f"no attribute {a}" for a in _attributes(proto) if not _has_attribute(impl, a)]
    for name in _methods(proto):
        if not callable(getattr(impl, name, None)):
            problems.append(f"no method {name}")
            continue
        want = list(inspect.signature(getattr(proto, name)).parameters.values())[1:]
        got = list(inspect.signature(getattr(impl, name)).parameters.values())[1:]
        for w, g in zip(want, got):
            if (w.name, w.kind, w.default) != (g.name, g.kind, g.default):
                problems.append(f"{name}: parameter {g.name}={g.default!r} where the protocol has {w}")
        if len(got) < len(want):
            problems.append(f"{name}: lacks {[str(p) for p in want[len(got) :]]}")
        extra = [
            p
            for p in got[len(want) :]
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if extra:
            problems.append(f"{name}: extra parameters without a default: {[p.name for p in extra]}")
    return problems


@pytest.mark.parametrize("proto,impl", CASES, ids=[f"{p.__name__}-{i.__name__}" for p, i in CASES])
def test_implementations_have_the_protocols_signatures(proto, impl):
    assert _methods(proto), proto
    assert signature_problems(proto, impl) == []


def test_the_check_sees_a_narrower_signature():
    """The check itself: a destination whose submit lacks prompt_ids, a source whose prefill names
    its first parameter otherwise or wants one more argument, a missing attribute."""

    class Narrow(FakeDestination):
        def submit(self, room, prompt_len, params):
            pass

    class Renamed(FakeSource):
        def prefill(self, rid, token_ids, params=None, extra=None):
            pass

        def release(self, request_id, hold):
            pass

    class NoFlag:
        pass

    assert [p.split(":")[0] for p in signature_problems(KVDestination, Narrow)] == ["submit"]
    assert [p.split(":")[0] for p in signature_problems(KVSource, Renamed)] == ["prefill", "release"]
    assert "no attribute stream_handoff" in signature_problems(KVSource, NoFlag)
