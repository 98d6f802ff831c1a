"""The HTTP contracts between the router and the servers (pdserve/contracts.py): torch-free, one
name per field (queue_depth only as the old alias of queued), stream lines parsed strictly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import contracts
from pdserve.contracts import DecodeCapacity, FinishEvent, PrefillInfo, TokenEvent, parse_event


def test_contracts_and_configs_import_without_torch():
    code = (
        "import sys, pdserve.contracts, pdserve.router.pool, pdserve.router.orchestrator, "
        "pdserve.prefill_server.config, pdserve.decode_server.config, pdserve.flags; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_queued_is_one_name_with_the_old_alias_read_and_sent():
    old = PrefillInfo.model_validate({"total_tokens": 64, "queue_depth": 3, "bootstrap": "tcp://h:1"})
    assert old.queued == 3  # an instance of the previous release
    assert PrefillInfo(total_tokens=64, queued=2, queue_depth=2).model_dump()["queued"] == 2
    assert DecodeCapacity.model_validate({"total_tokens": 64, "queued": 1}).queued == 1
    assert "queued" in contracts.LoadAnswer.model_fields and "queue_depth" not in DecodeCapacity.model_fields


@pytest.mark.parametrize(
    "body",
    [
        {"total_tokens": -1},
        {"total_tokens": "many"},
        {"total_tokens": 8, "queued": -2},
        {"total_tokens": 8, "bootstrap": "http://not-a-side-channel"},
        {"free_tokens": 8},
    ],
)
def test_a_load_answer_off_the_contract_is_refused(body):
    with pytest.raises(ValueError):
        PrefillInfo.model_validate(body)


def test_stream_events_round_trip_and_garbage_is_refused():
    assert parse_event(contracts.event_line(TokenEvent(token=7))) == TokenEvent(token=7)
    finish = FinishEvent(finish_reason="length", request_id="r")
    assert parse_event(contracts.event_line(finish)) == finish
    for line in (
        "not json",
        "[1]",
        '{"token": "5"}',
        '{"token": true}',
        '{"hello": 1}',
        '{"finish_reason": "x", "request_id": "r"}',
    ):
        with pytest.raises(ValueError):
            parse_event(line)


def test_request_bodies_keep_the_edge_limits():
    with pytest.raises(ValueError):
        contracts.GenerateRequest(token_ids=[1], max_tokens=0)
    with pytest.raises(ValueError):
        contracts.PrefillRequest(token_ids=[1], temperature=float("nan"))
    with pytest.raises(ValueError):
        contracts.PrefillRequest(token_ids=[1], request_id="../etc")
    assert contracts.GenerateRequest(token_ids=[1], bootstrap="tcp://10.0.0.1:5").bootstrap


def test_the_router_s_sampling_params_arrive_at_the_rank_unchanged():
    """One form on each side of the wire: the router's SamplingParams -> sampling_fields -> the body
    -> the instance's SamplingParams is the identity (a field sampling_fields drops, or the body
    renames, fails here; `generated` travels as a count, its ids the end of token_ids)."""
    import dataclasses

    from pdserve.contracts import GenerateRequest, PrefillRequest, sampling_fields
    from pdserve.request import SamplingParams

    sent = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop_token_ids=(3, 4),
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias=((7, 1.5),),
        logprobs=2,
        n=3,
        cache_namespace="ab" * 8,
        generated=(40, 41),
    )
    prompt = [1, 2, 40, 41]
    fields = sampling_fields(sent)
    asked = {f.name for f in dataclasses.fields(SamplingParams)}
    assert asked - set(fields) == {"max_tokens", "prompt_ids", "prompt_logprobs"}  # each body's own
    decode = GenerateRequest(token_ids=prompt, max_tokens=9, **fields).sampling_params(64, 9)
    assert decode == sent
    prefill = PrefillRequest(token_ids=prompt, prompt_logprobs=1, **fields).sampling_params(64, 9)
    assert prefill == dataclasses.replace(sent, prompt_logprobs=1)
    penalised = dataclasses.replace(sent, repetition_penalty=1.3)
    body = GenerateRequest(token_ids=prompt, max_tokens=9, **sampling_fields(penalised))
    assert body.sampling_params(64, 9) == dataclasses.replace(penalised, prompt_ids=tuple(prompt))
