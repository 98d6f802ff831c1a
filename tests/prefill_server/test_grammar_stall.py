"""Issue 40 item 1: a request with a huge grammar and n = 128 cannot stall a prefill instance.

The issue's request (a JSON schema of 12,000 string properties with patterns, n = 128) sent straight
to a real `pdserve prefill` (C_p = 2) with the internal token, as a router would after its caps or
as any token holder could: its grammar is validated on a worker thread, compiled once on the
instance's background compile thread (not per choice, not on a rank), and the job waits for it
while the loop serves others. A 1-token request sent while it compiles is answered in under 2 s;
the big one then completes with the first token the grammar allows."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve.engine.constraint import grammar_for
from pdserve.model.tokenizer import Tokenizer
from tests.engine.test_grammar_cache import big_schema
from tests.servers import AUTH, http, start_server, wait_until


@pytest.mark.slow
def test_a_12000_property_n128_grammar_leaves_other_requests_under_2s(tiny_checkpoints):
    model = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    grammar = grammar_for("json_schema", big_schema(12000))
    proc, url = start_server("prefill", model, "--cp-size", "2")
    try:
        big: dict = {}

        def send_big():
            with httpx.Client(headers=AUTH, timeout=600) as c:
                body = {
                    "token_ids": [5, 6, 7, 8],
                    "grammar": grammar,
                    "n": 128,
                    "temperature": 1.0,
                    "seed": 1,
                }
                big["reply"] = c.post(f"{url}/v1/prefill", json=body)

        sender = threading.Thread(target=send_big)
        sender.start()
        # the big body is in, validated, and its job queued while its grammar compiles
        wait_until(
            lambda: http.get(f"{url}/info", headers=AUTH).json()["queued"] >= 1,
            "the big job queued",
            120,
            0.05,
        )
        with httpx.Client(headers=AUTH, timeout=60) as c:
            start = time.monotonic()
            small = c.post(f"{url}/v1/prefill", json={"token_ids": [9, 10, 11]})
            took = time.monotonic() - start
        assert small.status_code == 200, small.text
        assert "reply" not in big, "the big request finished before the small one was sent: no contention"
        assert took < 2.0, f"a 1-token prefill took {took:.2f} s while a big grammar compiled"
        sender.join(timeout=600)
        reply = big["reply"]
        assert reply.status_code == 200, reply.text
        # the one token this grammar allows first (an object with required keys: `{"`); compiling it
        # again here to ask would cost the test as much as the instance's compile
        assert Tokenizer.from_pretrained(model).decode([reply.json()["first_token"]]) == '{"'

    finally:
        proc.terminate()
        proc.wait(timeout=30)
