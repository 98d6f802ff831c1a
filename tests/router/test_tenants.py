"""Tenant isolation of the prefix cache through the real stack (issue 40 item 4, router/tenants.py):
with two API keys the same prompt is cached once per key -- `cached_tokens` 0 across keys, > 0
within one key when --report-cached-tokens is on, and the decode's cache does not hit across keys
either; cache_salt narrows a key's namespace but never reaches another key's; without the flag
cached_tokens is always 0; /metrics needs a key; malformed key files are startup errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import httpx
import openai
import pytest
from pydantic import ValidationError

from pdserve.contracts import PrefillRequest
from pdserve.router.launch import Stack, StackConfig
from pdserve.router.tenants import MIN_API_KEY_CHARS, cache_namespace, load_api_keys
from tests.router.helpers import router_config, running_router
from tests.servers import http

KEYS = {"alice": "alice-key-5f0c1d9e2b7a", "bob": "bob-key-9a8e7d6c5b4f3"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("# tenants\n\n" + "".join(f"{n}:{k}\n" for n, k in KEYS.items()))
    return str(path)


def clients(url: str) -> dict[str, openai.OpenAI]:
    return {
        n: openai.OpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0, timeout=60) for n, k in KEYS.items()
    }


def cached(client: openai.OpenAI, prompt: list[int], salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0.0, extra_body=extra
    )
    return r.usage.prompt_tokens_details.cached_tokens


def decode_hits(d_url: str) -> int:
    return http.get(f"{d_url}/capacity").json()["prefix_hit_tokens"]


def test_the_prefix_cache_is_per_api_key(model_dir, instances, key_file):
    _, d_url = instances
    cfg = router_config(model_dir, *instances, api_key_file=key_file, report_cached_tokens=True)
    prompt = list(range(400, 440))  # 40 tokens: two whole 16-token prefill pages below the last token
    with running_router(cfg) as (url, _):
        c = clients(url)
        assert cached(c["alice"], prompt) == 0
        hits = decode_hits(d_url)
        assert cached(c["alice"], prompt) == 32  # within one key: the prefill's cache hit
        assert decode_hits(d_url) > hits  # and the decode's
        hits = decode_hits(d_url)
        assert cached(c["bob"], prompt) == 0  # across keys: nothing, on either side
        assert decode_hits(d_url) == hits
        assert cached(c["bob"], prompt) == 32  # bob's own copy
        # cache_salt narrows: alice with a salt starts empty, then hits within that salt only
        assert cached(c["alice"], prompt, "s1") == 0
        assert cached(c["alice"], prompt, "s1") == 32
        assert cached(c["alice"], prompt, "s2") == 0
        # ...and never widens: bob with alice's salt is still in bob's own namespace
        assert cached(c["bob"], prompt, "s1") == 0


def test_cached_tokens_are_not_reported_by_default(model_dir, instances, key_file):
    cfg = router_config(model_dir, *instances, api_key_file=key_file)
    prompt = list(range(450, 490))
    with running_router(cfg) as (url, _):
        alice = clients(url)["alice"]
        assert [cached(alice, prompt) for _ in range(3)] == [0, 0, 0]
        chunks = list(
            alice.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_need_an_api_key(model_dir, instances, key_file):
    with running_router(router_config(model_dir, *instances, api_key_file=key_file)) as (url, _):
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401
        wrong = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer x" * 3}, timeout=30)
        assert wrong.status_code == 401
        ok = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS['bob']}"}, timeout=30)
        assert ok.status_code == 200 and "pdserve_instance_prefix_hit_tokens" in ok.text
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "text, error",
    [
        ("alice alice-key-5f0c1d9e2b7a\n", "line 1: expected `name:key`"),
        ("# c\n:alice-key-5f0c1d9e2b7a\n", "line 2: expected `name:key`"),
        ("a/b:alice-key-5f0c1d9e2b7a\n", "line 1: expected `name:key`"),
        ("alice:short\n", f"shorter than {MIN_API_KEY_CHARS} characters"),
        (
            "alice:alice-key-5f0c1d9e2b7a\nalice:other-key-0123456789\n",
            "line 2: the name 'alice' is listed twice",
        ),
        (
            "alice:alice-key-5f0c1d9e2b7a\nbob:alice-key-5f0c1d9e2b7a\n",
            "line 2: the key of 'bob' is also 'alice'",
        ),
        ("# nothing\n\n", "holds no `name:key` line"),
    ],
)
def test_malformed_key_files_are_startup_errors(model_dir, tmp_path, text, error):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace("*", r"\*")):
        router_config(model_dir, "http://p", "http://d", api_key_file=str(path))


def test_principals_and_namespaces(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice:alice-key-5f0c1d9e2b7a\n")
    assert load_api_keys("single-key-0123456789", str(path)) == {
        "alice-key-5f0c1d9e2b7a": "alice",
        "single-key-0123456789": "default",
    }
    assert load_api_keys(None, None) is None
    with pytest.raises(ValueError, match="also 'alice'"):
        load_api_keys("alice-key-5f0c1d9e2b7a", str(path))
    assert cache_namespace(None) == ""  # no keys: the one shared namespace, as before
    spaces = {
        cache_namespace(*p) for p in [("a",), ("b",), ("a", None, "s"), ("b", None, "s"), ("a", "s"), ("as",)]
    }
    assert len(spaces) == 6 and all(len(s) == 32 for s in spaces)


def test_namespace_header_narrows_only_when_named(model_dir, instances, key_file):
    """--namespace-header X-Tenant: a gateway's tenant header splits a key's namespace; without the
    flag the same header is ignored (the request stays in the key's namespace)."""
    prompt = list(range(200, 240))
    bob = {"Authorization": f"Bearer {KEYS['bob']}"}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}

    def hit(url: str, tenant: str) -> int:
        r = httpx.post(f"{url}/v1/completions", json=body, headers={**bob, "X-Tenant": tenant}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cfg = router_config(model_dir, *instances, api_key_file=key_file, report_cached_tokens=True)
    with running_router(cfg) as (url, _):
        assert [hit(url, "t1"), hit(url, "t2")] == [0, 32]  # header ignored: bob's one namespace
    with running_router(dataclasses.replace(cfg, namespace_header="X-Tenant")) as (url, _):
        assert [hit(url, "t1"), hit(url, "t1"), hit(url, "t2")] == [0, 32, 0]


def test_instances_refuse_a_malformed_namespace():
    PrefillRequest(token_ids=[1], cache_namespace=cache_namespace("alice"))
    for bad in ("../x", "A" * 32, "a" * 65, "alice"):
        with pytest.raises(ValidationError):
            PrefillRequest(token_ids=[1], cache_namespace=bad)


def test_up_passes_the_tenant_flags_to_its_router(model_dir, key_file, tmp_path):
    cfg = StackConfig(
        model=str(model_dir), log_dir=str(tmp_path), report_cached_tokens=True, api_key_file=key_file
    )
    args = Stack(cfg).router_args(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args, "--check-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shown = json.loads(out.stdout)
    assert shown["report_cached_tokens"] is True and shown["api_key_file"] == key_file
    assert not any(k in out.stdout for k in KEYS.values())  # the keys themselves are never printed
    bad = tmp_path / "bad-keys"
    bad.write_text("alice:short\n")
    with pytest.raises(ValueError, match="shorter than"):
        StackConfig(model=str(model_dir), log_dir=str(tmp_path), api_key_file=str(bad))
