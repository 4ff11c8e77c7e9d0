import threading
import time

from bench.stack_sampler import StackSampler


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def _wait_here(stop: threading.Event) -> None:
    stop.wait()


def test_a_window_names_the_function_the_thread_sat_in_and_busiest_skips_waiting_threads():
    stop = threading.Event()
    busy = threading.Thread(target=_spin_here, args=(stop,), name="sluiceway-test-busy")
    idle = threading.Thread(target=_wait_here, args=(stop,), name="sluiceway-test-idle")
    outside = threading.Thread(target=_spin_here, args=(stop,), name="other-thread")
    for t in (busy, idle, outside):
        t.start()
    busy_clock = time.pthread_getcpuclockid(busy.ident)
    sampler = StackSampler(interval_s=0.002, duration_s=60.0).start()
    start, busy_cpu_at_start = time.time(), time.clock_gettime(busy_clock)
    # NOTE: a window of the busy thread's CPU time, not of wall time: on a loaded machine this
    # process runs a fraction of the time, its threads and the sampler alike (a window of 0.3 s
    # of wall time held 5 samples of the busy thread on 2 loaded cores)
    deadline = time.monotonic() + 30
    while time.clock_gettime(busy_clock) - busy_cpu_at_start < 0.15:
        assert time.monotonic() < deadline, "the busy thread had no 0.15 s of CPU in 30 s"
        time.sleep(0.01)
    end = time.time()
    sampler.stop()
    stop.set()
    for t in (busy, idle, outside):
        t.join()
    window = sampler.window(start, end, "sluiceway-test-busy")
    assert window["samples"] >= 10
    assert any("_spin_here" in frame for frame in window["stacks"][0]["frames"])
    assert "_wait_here" in " ".join(sampler.window(start, end, "sluiceway-test-idle")["stacks"][0]["frames"])
    assert sampler.window(start, end, "other-thread")["samples"] == 0  # not of the prefix
    # the CPU clocks: the spinning thread burned CPU in the window (it shares the GIL with the
    # other spinner), the waiting one next to none
    assert window["cpu_s"] > 0.03
    assert sampler.window(start, end, "sluiceway-test-idle")["cpu_s"] < 0.01
    others = sampler.busiest(start, end, exclude="sluiceway-test-idle")
    assert [w["thread"] for w in others] == ["sluiceway-test-busy"]
    assert sampler.window(end + 10, end + 20, "sluiceway-test-busy")["samples"] == 0
