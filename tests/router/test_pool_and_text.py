"""The router's plain-Python parts without servers: choosing instances (policies, capacity, drain,
retries elsewhere) and turning token ids into text with stop strings."""

from __future__ import annotations

import pytest

from pdserve.contracts import DecodeCapacity, PrefillInfo
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.pool import NoInstance, Pool, TooLong
from pdserve.router.text import TextStream


def pool_of(policy: str, decode_free: dict[str, int], total: int = 1000) -> Pool:
    pool = Pool(("http://p1", "http://p2"), tuple(decode_free), policy)
    for inst in pool.instances.values():  # what a successful health poll leaves behind
        inst.healthy = True
        inst.info = (
            PrefillInfo(bootstrap="tcp://h:1", total_tokens=total, queued=0)
            if inst.role == "prefill"
            else DecodeCapacity(total_tokens=total, free_tokens=decode_free[inst.url], queued=0)
        )
    return pool


def test_round_robin_alternates_and_skips_draining_and_unhealthy():
    pool = pool_of("round_robin", {"http://d1": 1000, "http://d2": 1000})
    assert [pool.pick("prefill", 10).url for _ in range(4)] == ["http://p1", "http://p2"] * 2
    pool.candidates("decode", 10)  # a check does not take a turn
    assert [pool.pick("decode", 10).url for _ in range(2)] == ["http://d1", "http://d2"]
    pool.get("http://p1").draining = True
    pool.suspect(pool.get("http://d2"), "connection refused")
    assert {pool.pick("prefill", 10).url for _ in range(4)} == {"http://p2"}
    assert {pool.pick("decode", 10).url for _ in range(4)} == {"http://d1"}
    pool.get("http://p2").healthy = False
    with pytest.raises(NoInstance, match="prefill"):
        pool.pick("prefill", 10)
    assert not pool.ready()


def test_least_load_and_capacity():
    pool = pool_of("least_load", {"http://d1": 100, "http://d2": 600})
    assert pool.pick("decode", 50).url == "http://d2"  # more free KV tokens
    pool.get("http://d2").in_flight = 2
    assert pool.pick("decode", 50).url == "http://d1"  # fewer in-flight requests first
    assert pool.pick("decode", 500).url == "http://d2"  # only d2 has room now
    pool.get("http://p1").in_flight = 1
    assert pool.pick("prefill", 5).url == "http://p2"
    assert pool.pick("prefill", 5, avoid={"http://p2"}).url == "http://p1"  # a retry goes elsewhere
    assert pool.pick("decode", 900).url in ("http://d1", "http://d2")  # nobody has room now: it queues
    with pytest.raises(TooLong, match="more than any decode instance holds"):
        pool.pick("decode", 1001)


def test_topology_changes():
    pool = pool_of("round_robin", {"http://d1": 10})
    with pytest.raises(ValueError, match="already registered"):
        pool.add("decode", "http://p1/")
    with pytest.raises(ValueError, match="role"):
        pool.add("router", "http://x")
    pool.remove("http://p1")
    with pytest.raises(KeyError):
        pool.get("http://p1")
    assert pool.add("prefill", "http://p1").healthy is False  # until its first poll


@pytest.fixture(scope="module")
def tok(tiny_checkpoints):
    return Tokenizer.from_pretrained(tiny_checkpoints[("glm_moe_dsa", "make-model")])


def feed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.add(t) for t in ids]


def test_text_without_stop_strings_is_the_decoded_text(tok):
    ids = tok.encode("héllo wörld, 你好 again")
    s = TextStream(tok)
    assert "".join(feed(s, ids)) + s.finish() == tok.decode(ids)
    assert not s.stopped and s.token_ids == ids


def test_stop_string_across_tokens_is_cut_and_its_prefix_held_back(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    s = TextStream(tok, stop=["gamma d"])
    out = feed(s, ids)
    assert s.stopped and "".join(out) == "alpha beta "
    assert s.finish() == "" and s.add(5) == ""
    assert len(s.token_ids) < len(ids)  # the tokens after the stop are not taken
    # a possible beginning of a stop string is held until it is ruled out
    s = TextStream(tok, stop=["beta gammX"])
    out = feed(s, ids)
    assert not s.stopped and "".join(out) + s.finish() == text
    assert not "".join(out[: len(tok.encode("alpha beta"))]).endswith("beta")
