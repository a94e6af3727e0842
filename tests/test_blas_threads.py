"""The BLAS's threads by phase: every core for rounds that prefill, one fewer for decode rounds unless
calibrated otherwise."""

from __future__ import annotations

import ctypes

import pytest

from protocol import messages as m
from worker import blas_threads
from worker.engine import Engine, EngineConfig


def blas_threads_now() -> int:
    """What the loaded BLAS itself reports it will use."""
    process = ctypes.CDLL(None)
    for name in ("MKL_Get_Max_Threads", "openblas_get_num_threads"):
        f = getattr(process, name, None)
        if f is not None:
            return f()
    pytest.skip("no BLAS with a thread setting is loaded (macOS's Accelerate): nothing to set")


@pytest.fixture
def phases(monkeypatch):
    """Distinct counts for the two phases whatever this machine's cores, set through the real BLAS."""
    setter = blas_threads._setter()
    if setter is None:
        pytest.skip("no BLAS thread setter (macOS's Accelerate), or a thread count the user set")
    monkeypatch.setattr(blas_threads, "_set", setter)
    monkeypatch.setattr(blas_threads, "PREFILL_THREADS", 2)
    monkeypatch.setattr(blas_threads, "DECODE_THREADS", 1)
    monkeypatch.setattr(blas_threads, "_now", None)
    monkeypatch.setattr(blas_threads, "WIDE_WORK", 1.0)  # any prefill is large enough here
    yield
    blas_threads.use()


def test_the_blas_runs_what_each_phase_sets(phases):
    blas_threads.use(prefill_work=1.0)
    assert blas_threads_now() == 2
    blas_threads.use()
    assert blas_threads_now() == 1


def test_a_thread_count_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert blas_threads._setter() is None


def test_prefill_rounds_use_every_core_and_decode_rounds_one_fewer(phases, tiny_llama_lm):
    engine = Engine(tiny_llama_lm, EngineConfig(max_active=2))
    req = m.GenerateRequest(messages=[m.Message("user", "Hello there")], max_tokens=6, temperature=0.0)
    engine.submit("a", req)
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(blas_threads_now())
        if len(seen) == 3:
            engine.submit("b", req)  # admitted beside a decoding request: that round prefills
    assert seen[0] == 2 and seen[1:3] == [1, 1]
    assert seen[3] == 2 and set(seen[4:]) == {1}


def test_a_small_prefill_stays_on_the_decode_threads(phases, monkeypatch, tiny_llama_lm):
    """Widening costs MKL's 200 ms spin after it: a small model's small prefill is not worth it."""
    monkeypatch.setattr(blas_threads, "WIDE_WORK", 16 * 135e6)
    engine = Engine(tiny_llama_lm, EngineConfig(max_active=2))
    engine.submit("a", m.GenerateRequest(messages=[m.Message("user", "Hello there")], max_tokens=4, temperature=0.0))
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(blas_threads_now())
    assert set(seen) == {1}
    blas_threads.use(prefill_work=16 * 135e6)  # the embedded model's 16-token prefill is
    assert blas_threads_now() == 2


def test_decode_rounds_take_the_count_that_timed_faster_at_their_size(phases, monkeypatch):
    """All cores win at 4 rows but not by the margin at one: one-row rounds keep the default,
    rounds of 4 rows and more take every core, as the BLAS itself then reports."""
    monkeypatch.setattr(blas_threads, "calibration", blas_threads.Calibration())
    times = {(1, 1): 0.040, (1, 2): 0.039, (4, 1): 0.090, (4, 2): 0.060}
    timed = []

    def round_seconds(rows: int) -> float:
        timed.append((rows, blas_threads_now()))
        return times[(rows, blas_threads_now())]

    out = blas_threads.calibrate(round_seconds, [1, 4])
    assert out.chosen == {1: 1, 4: 2}
    assert sorted(set(timed)) == sorted(times)  # each size timed at both counts, through the real BLAS
    for rows, threads in [(1, 1), (3, 1), (4, 2), (16, 2)]:
        blas_threads.use(rows=rows)
        assert blas_threads_now() == threads
    blas_threads.use(prefill_work=1.0, rows=1)
    assert blas_threads_now() == 2


def test_the_engine_times_its_rounds_on_rows_that_then_leave(phases, monkeypatch, tiny_llama_lm):
    monkeypatch.setattr(blas_threads, "calibration", blas_threads.Calibration())
    engine = Engine(tiny_llama_lm, EngineConfig(max_active=2))
    out = engine.calibrate_threads()
    assert sorted(out.seconds) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(t > 0 for t in out.seconds.values())
    assert not engine.runner.rows and not len(engine.runner.target)
    engine.submit("a", m.GenerateRequest(messages=[m.Message("user", "Hello there")], max_tokens=3, temperature=0.0))
    while engine.has_work():
        engine.step()
    assert engine.totals.finished == 1
