"""A newcomer's first run on the CPU (issue 24): numbers that repeat, and a report that says what they mean.

The timing tests use a fake step whose stalls are scheduled, so what the estimator keeps is known; the report tests
render a CPU record shaped like the README's first command's (tiny-llama, C=1,2, interpreted kernels) and read the
figures plotly would draw.
"""

import time

import pytest
import torch

from optiq.measure import timing
from optiq.measure.timing import CPU_THREADS, fixed_threads, time_repeats

CPU = torch.device("cpu")


def scheduled_step(durations):
    """A step that sleeps the next of ``durations`` (seconds) at each call."""
    pending = iter(durations)
    return lambda: time.sleep(next(pending))


def test_a_cpu_repeat_is_its_median_step_and_the_point_its_median_repeat():
    base, stall, steps = 0.001, 0.05, 16
    stalled_steps = [stall if i in (3, 7, 11) else base for i in range(steps)]  # the scheduler took the core 3 times
    slow_repeat = [10 * base] * steps  # another process ran through a whole repeat
    durations = stalled_steps + slow_repeat + stalled_steps
    resets = []
    repeats = time_repeats(scheduled_step(durations), lambda: resets.append(1), steps, 3, CPU)
    assert len(repeats) == 3 and len(resets) == 3
    # The mean of a stalled repeat is over 10 ms and the slow repeat's 10 ms: neither may be what a repeat or the
    # point reports. time.sleep overshoots on a loaded machine, hence the margin above base.
    assert repeats[0] < 4 * base and repeats[2] < 4 * base and repeats[1] >= 10 * base
    assert sorted(repeats)[1] < 4 * base


def test_cpu_measurements_run_on_fixed_threads_and_give_them_back():
    torch.set_num_threads(2)
    try:
        with fixed_threads(CPU) as threads:
            assert threads == CPU_THREADS == torch.get_num_threads()
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), fixed_threads(CPU):
            raise RuntimeError("a step that raised")
        assert torch.get_num_threads() == 2
        with fixed_threads(torch.device("cuda")) as threads:  # nothing to fix: no CUDA call is made
            assert threads is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize(("value", "interpreted"), [("1", True), ("ON", True), (" yes", True), ("0", False),
                                                    ("", False), ("2", False)])
def test_the_interpreter_is_read_as_triton_reads_it(monkeypatch, value, interpreted):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert timing.triton_interpreted() is interpreted
    assert timing.smoke(torch.device("cuda")) is interpreted and timing.smoke(CPU)


def test_a_measured_cpu_point_is_marked_smoke_with_its_threads():
    from optiq.measure.sweep import measure_point
    from optiq.models import load_model
    from optiq.record import Workload

    model = load_model("tiny-llama", torch.float32, CPU)
    seen = []

    def forward(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return model.forward(*args, **kwargs)

    before = torch.get_num_threads()
    row = measure_point(model, 1, Workload(8, 4, 32, 2), "eager", 1e11, forward=forward)
    assert row.smoke and row.threads == CPU_THREADS and set(seen) == {CPU_THREADS}
    assert torch.get_num_threads() == before
    assert len(row.ms_per_step_repeats) == 2 and row.ms_per_step == pytest.approx(
        sorted(row.ms_per_step_repeats)[0] / 2 + sorted(row.ms_per_step_repeats)[1] / 2)
    assert row.tok_per_s == pytest.approx(1e3 / row.ms_per_step)
