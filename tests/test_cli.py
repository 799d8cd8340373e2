"""python -m codegen.show, python -m codegen.warmup and python -m bench.op, without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends import ToolchainError
from backends.cuda.toolchain import find_tool, find_toolchain

REPO = Path(__file__).resolve().parents[1]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def run_main(main, capsys, *argv):
    """(exit code, stdout, stderr) of a command's main(argv) run in this process: the refusals are the
    same code path as `python -m ...` without another interpreter start (each test keeps one real
    command line)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def need_cuda_tools():
    try:
        find_toolchain()
        find_tool("cuobjdump")
    except ToolchainError as e:
        pytest.skip(f"CUDA 13 tools missing: {e}")


def test_show_prints_ascend_c():
    r = run("codegen.show", "rmsnorm", "--target", "ascend")
    assert r.returncode == 0, r.stderr
    assert "__simt_vf__" in r.stdout and "__global__" in r.stdout and "asc_vf_call" in r.stdout


def test_show_sass_histogram_on_sm_90a():
    need_cuda_tools()
    r = run("codegen.show", "rms_norm", "--target", "sm_90a", "--sass", "--no-source")
    assert r.returncode == 0, r.stderr
    assert "SASS summary (sm_90a)" in r.stdout and "registers/thread" in r.stdout
    assert "LDG" in r.stdout and "STG" in r.stdout


def test_show_rules_and_list(capsys):
    from codegen.show import main

    r = run("codegen.show", "--rules")
    assert r.returncode == 0 and "mma" in r.stdout and "cuda:sm_100a <- codegen.lowering.sm100" in r.stdout
    code, out, _ = run_main(main, capsys, "--list")
    assert code == 0 and "rmsnorm" in out
    assert "mla_decode_fp8_rows64 " in out and "mla_decode_fp8_rs2 " in out     # the ops' kernel variants too


def test_show_errors_are_clear(capsys):
    from codegen.show import main

    r = run("codegen.show", "nosuchop")
    assert r.returncode == 2 and "no tile program 'nosuchop'" in r.stderr
    code, _, err = run_main(main, capsys, "rmsnorm", "--target", "ascend", "--sass")
    assert code == 2 and "--sass needs a CUDA target" in err
    code, _, err = run_main(main, capsys, "rmsnorm", "--target", "tpu")
    assert code == 2 and "unknown target 'tpu'" in err


def test_warmup_fills_the_disk_cache(tmp_path):
    import os

    env = {**os.environ, "TILECRAFT_CACHE_DIR": str(tmp_path)}
    r = run("codegen.warmup", "rmsnorm", "--target", "cpu", "--example", "kv-lora", env=env)
    assert r.returncode == 0, r.stderr
    assert "1 kernels ready for cpu" in r.stdout
    assert len(list((tmp_path / "v1").glob("??/*/manifest.json"))) == 1


def test_warmup_grid_in_parallel(tmp_path, capsys):
    """--grid varies parameters over the example (cartesian product), --jobs compiles in processes;
    a name the program does not take fails before any compile."""
    import os

    env = {**os.environ, "TILECRAFT_CACHE_DIR": str(tmp_path)}
    r = run("codegen.warmup", "rmsnorm", "--target", "cpu", "--example", "kv-lora", "--grid", "hidden=64,128",
            "--grid", "dtype=float32,bfloat16", "--jobs", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert "4 kernels ready for cpu" in r.stdout
    assert len(list((tmp_path / "v1").glob("??/*/manifest.json"))) == 4
    from codegen.warmup import main

    code, _, err = run_main(main, capsys, "rmsnorm", "--target", "cpu", "--grid", "width=1,2")
    assert code == 2 and "width" in err


def test_bench_without_gpu_reports_floors_and_static_stats():
    need_cuda_tools()
    r = run("bench.op", "rms_norm", "--shape", "small")
    assert r.returncode == 0, r.stderr
    assert "Timing needs a CUDA GPU" in r.stdout
    assert "floor" in r.stdout and "memory-bound" in r.stdout and "registers/thread" in r.stdout


def test_bench_errors_are_clear(capsys):
    from bench.op import main

    r = run("bench.op", "rms_norm", "--shape", "huge")
    assert r.returncode == 2 and "no preset 'huge'" in r.stderr
    code, _, err = run_main(main, capsys, "nosuch", "--shape", "x")
    assert code == 2 and "no benchmark for op 'nosuch'" in err


def test_bench_provider_choice():
    """Experimental kernel variants (the MLA FP8 options) are timed only when named; unknown names
    are a clear error."""
    from bench import suites
    from bench.op import choose_providers

    mla = suites.get("mla")
    default = {p.name for p in choose_providers(mla, None)}
    assert {"tilecraft", "tilecraft-fp8", "torch"} <= default and not any("staged" in n for n in default)
    assert [p.name for p in choose_providers(mla, ["tilecraft-fp8-staged", "tilecraft"])] == [
        "tilecraft", "tilecraft-fp8-staged"]
    with pytest.raises(ValueError, match="unknown providers"):
        choose_providers(mla, ["tilecraft-nosuch"])


def test_fp8_cache_providers_count_their_own_bytes():
    """The MLA FP8 cache's providers quote GB/s, %ceil and the floor on 656-byte tokens, the rest on
    the bf16 cache's 1152."""
    from bench import suites

    mla = suites.get("mla")
    case = mla.presets["fp8"][0]
    tokens = sum(suites.mla.seqlens(case))
    by_name = {p.name: p for p in mla.providers}
    fp8 = [n for n in by_name if "fp8" in n]
    assert fp8 and all(by_name[n].nbytes is not None for n in fp8)
    assert all(by_name[n].nbytes is None for n in ("tilecraft", "torch", "flash_mla"))
    assert mla.nbytes(case) - by_name["tilecraft-fp8"].nbytes(case) == tokens * (1152 - 656)


def test_bench_result_files(tmp_path):
    from bench import suites
    from bench.op import write_results

    rows = [{"case": "rows=1", "provider": "tilecraft", "median_ms": 0.01, "gbps": 100.0},
            {"case": "rows=1", "provider": "torch", "median_ms": 0.02, "gbps": 50.0}]
    meta = {"gpu": "NVIDIA H200", "torch": "2.11", "tilelang": "0.1.15", "tilecraft": "0.1.0"}
    base = write_results(rows, meta, suites.get("rms_norm"), "small", tmp_path, plot=False)
    data = json.loads(Path(f"{base}.json").read_text())
    assert data["meta"]["gpu"] == "NVIDIA H200" and len(data["rows"]) == 2
    csv_text = Path(f"{base}.csv").read_text()
    assert "# gpu: NVIDIA H200" in csv_text and "tilecraft" in csv_text


def test_bench_output_agreement():
    """bench.op compares every provider's output with the first provider's on the same inputs."""
    import torch

    from bench.op import agreement

    y = torch.randn(4, 8, dtype=torch.bfloat16)
    same = agreement((y.clone(), torch.zeros(4)), (y, torch.ones(4)))   # MLA's (out, lse): the first tensor
    assert same["max_abs_diff"] == 0.0 and same["rel_diff"] == 0.0 and "agree_note" not in same
    off = y.clone()
    off[1, 2] += 1.0
    d = agreement(off, y)
    assert abs(d["max_abs_diff"] - (off[1, 2].float() - y[1, 2].float()).item()) < 1e-6 and d["rel_diff"] > 0
    nan = y.clone()
    nan[0, 0] = float("nan")
    d = agreement(nan, y)
    assert d["agree_note"] == "non-finite output" and d["max_abs_diff"] == float("inf")
    assert agreement(y[:2], y)["agree_note"].startswith("shape")
    assert agreement(None, y) == {"agree_note": "no tensor returned"}


def test_bench_times_without_value_checks(monkeypatch):
    """The timed calls skip the device-syncing value checks; the setting is put back after."""
    import os

    from bench.op import values_unchecked
    from ops import _values

    monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "1")
    with values_unchecked():
        assert not _values.enabled()
    assert _values.enabled() and os.environ["TILECRAFT_CHECK_VALUES"] == "1"
    monkeypatch.delenv("TILECRAFT_CHECK_VALUES")
    with values_unchecked():
        assert not _values.enabled()
    assert "TILECRAFT_CHECK_VALUES" not in os.environ


def _fake_nvidia_smi(tmp_path, monkeypatch, script):
    # an nvidia-smi on PATH that runs `script` (sh), with CUDA_VISIBLE_DEVICES mapping torch's device 1 to GPU 5
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")


def test_sm_clock_samples_nvidia_smi_while_a_block_runs(tmp_path, monkeypatch):
    """bench.timing.SmClock: the medians of the SM clock and the power nvidia-smi streams while the block
    runs, asked for the GPU CUDA_VISIBLE_DEVICES maps the device to; None where there is no nvidia-smi."""
    import time

    from bench.timing import SmClock

    # a driver without power.draw.instant refuses that field (exit 2): the plain one is asked for then
    _fake_nvidia_smi(tmp_path, monkeypatch,
                     'case "$*" in *loop-ms*) ;; *) [ -e "$(dirname "$0")/old" ] && exit 2; echo 500; exit 0;; esac\n'
                     'echo "$@" > "$(dirname "$0")/args"\nprintf "1755, 412.5\\n1410, 690.25\\n1980, [N/A]\\n"\n'
                     'exec sleep 30\n')
    for old_driver, field in ((False, "power.draw.instant"), (True, "power.draw")):
        if old_driver:
            (tmp_path / "old").touch()
        monkeypatch.setattr(SmClock, "_power_field", None)
        with SmClock(device=1) as clock:
            time.sleep(0.5)
        assert clock.samples == [1755, 1410, 1980] and clock.median() == 1755
        assert clock.watts == [412.5, 690.25] and clock.median_watts() == 551.375
        args = (tmp_path / "args").read_text().split()
        assert args[:3] == ["-i", "5", f"--query-gpu=clocks.sm,{field}"], args
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with SmClock() as clock:
        pass
    assert clock.median() is None


def test_card_identity_names_the_card_nvidia_smi_reports(tmp_path, monkeypatch):
    """bench.timing.card_identity: the UUID, power limit, top SM clock, temperature and driver of the card
    CUDA_VISIBLE_DEVICES maps the device to ([N/A] fields left out); {} without nvidia-smi or when it fails."""
    from bench.timing import card_identity

    _fake_nvidia_smi(tmp_path, monkeypatch,
                     'echo "$@" > "$(dirname "$0")/args"\n[ -e "$(dirname "$0")/fail" ] && exit 9\n'
                     'echo "GPU-d785a325-8dea, 700.00, 1980, [N/A], 580.159.04"\n')
    assert card_identity(1) == {"gpu_uuid": "GPU-d785a325-8dea", "gpu_power_limit": "700.00",
                                "gpu_clocks_max_sm": "1980", "gpu_driver_version": "580.159.04"}
    assert (tmp_path / "args").read_text().split()[:2] == ["-i", "5"]
    (tmp_path / "fail").touch()
    assert card_identity(0) == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert card_identity(0) == {}


def test_warm_calls_each_case_and_provider_in_worker_processes(monkeypatch, tmp_path):
    """bench.warm (bench.op --jobs): every (case, provider) of the run called once in spawned workers,
    in order, a failing one reported with its error; nothing with one job or with the disk cache off
    (the workers' compiles would not reach the timing process)."""
    from bench.warm import warm

    monkeypatch.setenv("TILECRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILECRAFT_DISABLE_DISK_CACHE", raising=False)
    done = warm("rmsnorm", "small", ["torch", "nope"], jobs=2, device="cpu")
    labels = ["rows=1 hidden=512 bfloat16", "rows=7 hidden=512 bfloat16"]
    assert [(c, p) for c, p, _ in done] == [(c, p) for c in labels for p in ("torch", "nope")]
    assert [err for _, p, err in done if p == "torch"] == [None, None]
    assert all("no provider 'nope'" in err for _, p, err in done if p == "nope")
    assert warm("rms_norm", "small", ["torch"], jobs=1, device="cpu") == []
    monkeypatch.setenv("TILECRAFT_DISABLE_DISK_CACHE", "1")
    assert warm("rms_norm", "small", ["torch"], jobs=2, device="cpu") == []


def test_sweep_mxfp4_warps_compiles_ahead_in_worker_processes(monkeypatch, tmp_path):
    """bench.sweep_mxfp4_warps --jobs: every (case, variant) launched once in spawned workers, in order, each
    worker's error reported (on the CPU: the warp kernel has no cpu lowering; a bad knob names itself); nothing
    with one job or with the disk cache off."""
    from bench.sweep_mxfp4_warps import compile_ahead

    monkeypatch.setenv("TILECRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILECRAFT_DISABLE_DISK_CACHE", raising=False)
    done = compile_ahead(["1x256x512", "8x256x512"], ["", "bogus=1"], jobs=2, device="cpu")
    assert [(c, v) for c, v, _ in done] == [(c, v) for c in ("1x256x512", "8x256x512") for v in ("", "bogus=1")]
    assert all("no lowering for cpu" in err for _, v, err in done if v == "")
    assert all("variant knob must be" in err for _, v, err in done if v == "bogus=1")
    assert compile_ahead(["1x256x512"], [""], jobs=1, device="cpu") == []
    monkeypatch.setenv("TILECRAFT_DISABLE_DISK_CACHE", "1")
    assert compile_ahead(["1x256x512"], [""], jobs=2, device="cpu") == []


def test_bench_rounds_rotate_the_provider_order_and_combine_by_median():
    """bench.op --rounds N: round r starts at provider r mod n (each provider first once with N = n); a
    provider's rounds combine to the median of their medians and quantiles, the least minimum, summed
    reps, median clock and power (rounds without a reading left out), and the list of round medians."""
    from bench.op import combine_rounds, main, rotations

    assert rotations(3, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert rotations(2, 3) == [[0, 1], [1, 0], [0, 1]] and rotations(0, 2) == []
    one = {"median_ms": 1.0, "min_ms": 0.9, "p20_ms": 0.95, "p80_ms": 1.1, "reps": 10, "sm_mhz": 1500, "watts": 700}
    assert combine_rounds([one]) is one
    ts = [one, {**one, "median_ms": 3.0, "min_ms": 0.5, "sm_mhz": None, "watts": None}, {**one, "median_ms": 2.0, "watts": 600}]
    got = combine_rounds(ts)
    assert got["median_ms"] == 2.0 and got["min_ms"] == 0.5 and got["reps"] == 30
    assert got["sm_mhz"] == 1500 and got["watts"] == 650 and got["round_median_ms"] == [1.0, 3.0, 2.0]
    assert main(["gemm", "--shape", "decode", "--rounds", "0"]) == 2


def _fake_gpu_run(monkeypatch):
    """bench.op.run_gpu's surroundings faked for a CPU test (the SM clock, the warm-up, a known GPU name, torch.cuda's
    device calls); returns a one-case suite (preset "x", reference provider "a") to run providers on."""
    import torch

    import bench.op as op
    from bench.suites import Suite

    class Clock:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        median, median_watts = (lambda self: 1500), (lambda self: 700)

    monkeypatch.setattr(op, "SmClock", Clock)
    monkeypatch.setattr(op, "warm_and_say", lambda *a: None)
    monkeypatch.setattr(op, "gpu_name", lambda: "NVIDIA H200")        # (a known GPU: no copy measured)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return Suite(name="fake", presets={"x": [dict(n=1)]}, make_inputs=lambda c, d: {}, nbytes=lambda c: 1e6,
                 flops=lambda c: 1e9, providers=[], kernels=lambda c, t: [], reference="a")


def test_bench_gpu_loop_with_rounds(monkeypatch, capsys):
    """run_gpu's loop on fakes (no GPU): every provider called once for its output, then timed in each
    round's rotated order; a provider that cannot make the case reports its error and is not timed; a
    provider whose timing fails reports that; the others' rows combine their rounds."""
    import argparse

    import bench.op as op
    import bench.timing as timing
    from bench.suites import Provider

    order = []

    def fake_bench(fn, **kw):
        name = fn()
        order.append(name)
        if name == "bad-timing":
            raise RuntimeError("boom")
        ms = {"a": 1.0, "b": 2.0}[name] * (1 + 0.1 * len(order))
        host = {"a": 0.5, "b": 3.0}[name] * ms          # b's host is slower than its GPU: host-bound
        return {"median_ms": ms, "min_ms": ms, "p20_ms": ms, "p80_ms": ms, "reps": 10, "host_ms": host,
                "gpu_rep_ms": ms, "host_bound": timing.host_bound(host, ms)}

    monkeypatch.setattr(timing, "bench_cuda", fake_bench)
    suite = _fake_gpu_run(monkeypatch)

    def provider(name):
        def make(case, inputs):
            if name == "cannot":
                raise ValueError("not this shape")
            return lambda: name
        return Provider(name, make)

    provs = [provider(n) for n in ("a", "cannot", "b", "bad-timing")]
    args = argparse.Namespace(shape="x", jobs=1, measure_ceilings=False, graph=False, flush="write", rounds=3)
    rows, meta = op.run_gpu(suite, suite.presets["x"], provs, args)
    assert order == ["a", "b", "bad-timing", "b", "a", "a", "b"]     # bad-timing dropped after it failed
    by = {r["provider"]: r for r in rows}
    assert "not this shape" in by["cannot"]["error"] and "boom" in by["bad-timing"]["error"]
    assert by["a"]["round_median_ms"] == pytest.approx([1.1, 1.5, 1.6]) and by["a"]["median_ms"] == pytest.approx(1.5)
    assert by["b"]["reps"] == 30 and by["b"]["sm_mhz"] == 1500 and by["b"]["min_ms"] == pytest.approx(2.4)
    assert by["b"]["speedup_vs_ref"] == by["a"]["median_ms"] / by["b"]["median_ms"] and meta["rounds"] == 3
    # a provider whose host issued reps as slowly as its GPU ran them is flagged, and told to use --graph
    assert by["b"]["host_bound"] and not by["a"]["host_bound"]
    err = capsys.readouterr().err
    flagged = [line for line in err.splitlines() if "host-bound" in line]
    assert len(flagged) == 1 and flagged[0].strip().startswith("b on ") and "--graph" in flagged[0], err


def test_bench_times_a_provider_that_syncs_with_the_host_eagerly_under_graph(monkeypatch, capsys):
    """--graph captures each provider's call in a CUDA graph, except a provider marked graphable=False (the MLA
    suite's torch reference reads each sequence's length on the host): that one is timed eagerly, its row says so,
    and the run says it on stderr (session 74: its capture failed and the h128 run printed no rows)."""
    import argparse

    import bench.op as op
    import bench.timing as timing
    from bench.suites import Provider
    from bench.suites.mla import SUITE as MLA

    used = []

    def fake(kind):
        def bench(fn, **kw):
            used.append((fn(), kind))
            return {"median_ms": 1.0, "min_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "reps": 10}
        return bench

    monkeypatch.setattr(timing, "bench_cuda", fake("eager"))
    monkeypatch.setattr(timing, "bench_graph", fake("graph"))
    suite = _fake_gpu_run(monkeypatch)
    provs = [Provider("a", lambda c, i: (lambda: "a")), Provider("ref", lambda c, i: (lambda: "ref"), graphable=False)]
    args = argparse.Namespace(shape="x", jobs=1, measure_ceilings=False, graph=True, flush="write", rounds=1)
    rows, _ = op.run_gpu(suite, suite.presets["x"], provs, args)
    assert sorted(used) == [("a", "graph"), ("ref", "eager")]
    by = {r["provider"]: r for r in rows}
    assert by["ref"]["timing"] == "eager" and "timing" not in by["a"]
    assert "ref on n=1: timed eagerly" in capsys.readouterr().err
    assert next(p for p in MLA.providers if p.name == "torch").graphable is False


def test_bench_notes_eager_rows_whose_median_is_far_from_their_min():
    from bench.op import spread_notes

    rows = [dict(case="mxfp4 1x7168x2048", provider="tilecraft", median_ms=0.0297, min_ms=0.0103),
            dict(case="mxfp4 1x7168x2048", provider="torch", median_ms=0.0160, min_ms=0.0144),
            dict(case="b=1", provider="flash_mla", error="boom")]
    notes = spread_notes(rows, "eager")
    assert len(notes) == 1 and "tilecraft on mxfp4 1x7168x2048" in notes[0] and "2.9x its min" in notes[0]
    assert "--graph" in notes[0]
    assert spread_notes(rows, "cuda graph") == []


def test_with_switch_sets_the_switch_for_the_compile_and_every_call():
    import types

    from bench.suites import with_switch

    module, seen = types.SimpleNamespace(X=0), []

    def make(case, inputs):
        seen.append(("make", module.X))
        return lambda: seen.append(("call", module.X)) or "out"

    run = with_switch(make, module, "X", 1)(None, None)
    assert module.X == 0
    assert run() == "out" and module.X == 0
    assert seen == [("make", 1), ("call", 1)]
