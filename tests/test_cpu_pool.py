"""The front end's CPU pool: urgent jobs before bulk ones, results and errors handed back, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from flashasr.serve.cpu_pool import CPUPool


def test_urgent_jobs_start_before_every_queued_bulk_job():
    pool = CPUPool(1, "t")
    gate, started, order = threading.Event(), threading.Event(), []
    try:
        first = pool.submit(lambda: (started.set(), gate.wait(10)))  # holds the only thread
        assert started.wait(5)
        bulk = [pool.submit(order.append, f"bulk{i}") for i in range(3)]
        urgent = [pool.submit(order.append, f"urgent{i}", urgent=True) for i in range(2)]
        assert pool.waiting() == (2, 3)
        gate.set()
        for f in [first, *bulk, *urgent]:
            f.result(5)
        assert order == ["urgent0", "urgent1", "bulk0", "bulk1", "bulk2"]
        assert pool.waiting() == (0, 0)
    finally:
        pool.shutdown()


def test_results_errors_threads_and_asyncio():
    pool = CPUPool(2, "named")
    try:
        assert pool.submit(lambda a, b=0: a + b, 1, b=2).result(5) == 3
        assert pool.submit(lambda: threading.current_thread().name).result(5).startswith("named-")
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)

        async def go():
            loop = asyncio.get_running_loop()
            return await pool.run(sum, [1, 2], urgent=True), await loop.run_in_executor(pool, max, 4, 5)

        assert asyncio.run(go()) == (3, 5)
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print)
    with pytest.raises(ValueError):
        CPUPool(0)


def test_shutdown_cancels_what_has_not_started():
    pool = CPUPool(1, "t")
    gate, started = threading.Event(), threading.Event()
    running = pool.submit(lambda: (started.set(), gate.wait(10))[1])
    assert started.wait(5)
    queued = pool.submit(print, "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(5) is True
