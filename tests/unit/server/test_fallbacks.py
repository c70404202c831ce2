"""Silent fallbacks (``pod.fallbacks``): counted per reason, and the pod condition raised only while one reason
crossed the threshold within the window, cleared once the window holds fewer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdfleet_runtime.pod.fallbacks import FALLBACK_THRESHOLD, FallbackReason, SilentFallbacks


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _fallbacks() -> tuple[SilentFallbacks, CollectorRegistry, Clock]:
    r, clock = CollectorRegistry(), Clock()
    return SilentFallbacks(r, "decode", window_s=60, clock=clock), r, clock


def test_every_reason_is_exported_at_zero_before_the_first() -> None:
    _, r, _ = _fallbacks()
    text = generate_latest(r).decode()
    for reason in FallbackReason:
        assert f'pdfleet_silent_fallbacks_total{{reason="{reason.value}",role="decode"}} 0.0' in text


def test_the_condition_needs_the_threshold_within_the_window_and_clears_after() -> None:
    fb, r, clock = _fallbacks()
    assert not fb.verdict().active
    for _ in range(FALLBACK_THRESHOLD - 1):
        fb.count(FallbackReason.NO_STATE_RECEIVED)
        clock.t += 10
    assert not fb.verdict().active, "below the threshold: one is a race"
    fb.count(FallbackReason.NO_STATE_RECEIVED)
    v = fb.verdict()
    assert v.active and v.reason == "NoStateReceived" and "recomputes prompts" in v.message
    clock.t += 45  # the first two leave the window
    assert not fb.verdict().active
    assert r.get_sample_value("pdfleet_silent_fallbacks_total", {"role": "decode", "reason": "no_state_received"}) \
        == FALLBACK_THRESHOLD


def test_spread_out_fallbacks_never_raise_it_and_reasons_count_apart() -> None:
    fb, r, clock = _fallbacks()
    for _ in range(10):
        fb.count(FallbackReason.UNCLAIMED_STATE)
        clock.t += 31  # two at most within any 60 s
    assert not fb.verdict().active
    fb.count(FallbackReason.SHORT_TRANSFER, 5)
    v = fb.verdict()
    assert v.active and v.reason == "ShortTransfer" and "unclaimed" not in v.message
    assert r.get_sample_value("pdfleet_silent_fallbacks_total", {"role": "decode", "reason": "unclaimed_state"}) == 10
    assert r.get_sample_value("pdfleet_silent_fallbacks_total", {"role": "decode", "reason": "short_transfer"}) == 5
