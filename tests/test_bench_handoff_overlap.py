"""bench/handoff_overlap.py on a tiny checkpoint and a short prompt: both ways hand off and are
timed on the decode ranks' own stamps, the unstreamed prefill's rows go out again into fresh rooms
(`--resends`), each followed by a floor round, and the rate is taken over all of them."""


def test_a_short_run_times_every_send_against_as_many_floor_rounds(bench_module, tiny_checkpoints):
    bench = bench_module("handoff_overlap")
    model = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])
    out = bench.measure(model, "nixl", 256, repeats=1, resends=2)
    s, u = out["streamed"], out["unstreamed"]
    assert u["sends_s"]["n"] == 3 and "sends_s" not in s  # the hand-off itself and 2 resends
    assert out["verified_floor"]["seconds"]["all"] and len(out["verified_floor"]["seconds"]["all"]) == 3
    for r in (s, u):
        assert r["ttft_s"]["min"] >= r["handoff_s"]["min"] > 0 and r["exposed_s"]["min"] >= 0
        assert r["poll_lag_s"]["min"] >= 0  # the ranks' stamps come before this process sees them
        assert r["bytes"] == u["bytes"] > 0
    assert u["GBps_median"] == u["bytes"] / u["sends_s"]["median"] / 1e9
    assert out["rate_over_verified_floor"] == u["GBps_median"] / out["verified_floor"]["GBps_median"]
