"""Compile a bench run's kernels in parallel before it is timed.

Each (case, provider) of the run is called once in a pool of worker processes; what they compile lands
in Tilecraft's disk cache (TILECRAFT_CACHE_DIR; a peer's JIT keeps its own) and the timing process
then loads it instead of compiling one kernel after another. On the H200 host a cold FP8 decode grid
compiled about one kernel a minute in the timing process (bench/NOTES.md "Session 31").
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

from tilecraft import env


def _one(task: tuple) -> tuple[str, str, str | None]:
    # in a worker: (op, preset, case index, provider name, device) -> (case label, provider, error or None)
    op, preset, index, name, device = task
    import torch

    from bench import suites

    suite = suites.get(op)
    case = suite.presets[preset][index]
    try:
        provider = next((p for p in suite.providers if p.name == name), None)
        if provider is None:
            raise ValueError(f"{suite.name} has no provider {name!r}")
        provider.make(case, suite.make_inputs(case, torch.device(device)))()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return suite.label(case), name, None
    except Exception as e:      # the timed run meets it again and reports it
        return suite.label(case), name, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def warm(op: str, preset: str, providers: list[str], jobs: int, device: str = "cuda") -> list[tuple]:
    """Call every (case of `preset`, provider) of bench suite `op` once, in `jobs` spawned processes on
    `device`. Returns (case label, provider, error or None) per call, in order. Nothing is run (an
    empty list) with jobs < 2 or with the disk cache off (TILECRAFT_DISABLE_DISK_CACHE): the workers'
    compiles would not reach the timing process."""
    from bench import suites

    if jobs < 2 or env.flag("TILECRAFT_DISABLE_DISK_CACHE"):
        return []
    suite = suites.get(op)
    tasks = [(suite.name, preset, i, name, device) for i in range(len(suite.presets[preset])) for name in providers]
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_one, tasks))


def warm_and_say(op: str, preset: str, providers: list[str], jobs: int) -> None:
    """warm() on the GPU with a line saying what it did."""
    t0 = time.perf_counter()
    done = warm(op, preset, providers, jobs)
    if done:
        failed = sum(err is not None for *_, err in done)
        print(f"compiled ahead in {jobs} processes: {len(done)} (case, provider) calls in "
              f"{time.perf_counter() - t0:.0f} s" + (f", {failed} failed (reported below)" if failed else ""))
