"""When a step saves, stops, or neither: the pure trigger functions, in process."""

from __future__ import annotations

from unbroken import RunConfig
from unbroken.train._triggers import Clock, Seen, decide, next_save_text, observe


def test_step_count_and_final_saves() -> None:
    cfg = RunConfig(save_every=5)
    saves = [s for s in range(1, 13) if decide(cfg, s, Seen(), complete=s == 12).save]
    assert saves == [5, 10, 12]
    last = decide(cfg, 12, Seen(), complete=True)
    assert last.final and last.stop is None
    no_final = RunConfig(save_every=5, save_final=False)
    assert not decide(no_final, 12, Seen(), complete=True).save


def test_stops_save_and_say_why() -> None:
    cfg = RunConfig()
    d = decide(cfg, 3, Seen(signalled=True), complete=False, signal_name="SIGTERM")
    assert (d.save, d.stop) == (True, "signal SIGTERM")
    d = decide(cfg, 3, Seen(signalled=True), complete=False)
    assert d.stop == "signal on another rank"  # agreed from another rank's flag
    assert decide(cfg, 3, Seen(out_of_time=True), complete=False).stop == "time limit"
    assert decide(cfg, 3, Seen(minutes_due=True), complete=False).save
    assert decide(cfg, 3, Seen(), complete=False, epoch_save_pending=True).save
    assert not decide(cfg, 3, Seen(), complete=False).save


def test_observe_keeps_a_step_a_save_and_the_margin_before_the_deadline() -> None:
    cfg = RunConfig(time_margin=10, save_every_minutes=1)
    base = Clock(now=1000, last_save=1000, step_seconds=5, save_seconds=3, deadline=1019)
    assert not observe(cfg, base, False).out_of_time  # 1000 + 5 + 3 + 10 < 1019
    late = Clock(now=1001, last_save=1000, step_seconds=5, save_seconds=3, deadline=1019)
    assert observe(cfg, late, False).out_of_time
    due = Clock(now=1060, last_save=1000)
    assert observe(cfg, due, True) == Seen(signalled=True, minutes_due=True)
    assert not observe(RunConfig(), due, False).minutes_due


def test_next_save_text_counts_right() -> None:
    cfg = RunConfig(save_every=10)
    clock = Clock(now=0, last_save=0)
    assert next_save_text(cfg, 9, clock) == "next save in 1 step"
    assert next_save_text(cfg, 3, clock) == "next save in 7 steps"
    assert next_save_text(RunConfig(), 3, clock) == ""
