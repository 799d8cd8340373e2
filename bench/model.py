"""Benchmark the whole model: prefill and decode throughput, where decode time goes, and transformers.

    python -m bench.model MODEL_DIR --batch B --input-len L --output-len N [--keep-fp8] [--repeat 1]
                          [--time-budget SECONDS] [--json out.json]

B random prompts of L tokens each generate N tokens (EOS ignored), after a short warm-up generate
(kernel compiles, CUDA-graph capture). The N - 1 decode steps of a timed generate are split into:
  timed      plain steps (CUDA-graph replays on a GPU): decode steps/s and tokens/s;
  profiled   steps under torch.profiler (GPU only): the kernel share, defined as the union of the
             CUDA kernel intervals recorded during those steps over their wall time (host clock,
             device synchronized at every step boundary; a step = input preparation, graph replay,
             sampling). Graph replays launch their kernels back to back, so this is what the GPU
             spends in kernels per step, and 1 - share is launch gaps, host work and idle time;
  eager      steps run op by op with the device synchronized around every op, taking the same
             (graph-capture) code path as the replays: the share of decode time per op family.
On a GPU it then frees our model and runs transformers' DeepseekV3ForCausalLM on the same checkpoint
(--compare / --no-compare to force): FP8 natively where transformers can (its FineGrainedFP8 path),
else with the FP8 weights dequantized to bf16 at load (said in the output). Its decode is timed on a
cache filled with random keys and values of the prompt length (decode cost does not depend on their
values; this skips its prefill), at the largest batch <= B whose cache fits next to its weights.
--time-budget keeps the whole command under that many seconds: phases are shortened or skipped,
and a watchdog writes the JSON gathered so far and exits (code 3) if the budget still runs out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

FAMILY_ORDER = ("gemm", "fp8_gemm", "mla_decode", "mla_prefill", "rms_norm", "rope", "moe_route", "moe_dispatch",
                "moe_gemm", "moe_combine", "act")
KERNEL_SHARE_DEF = ("union of CUDA kernel intervals (torch.profiler, CUDA activity) during the profiled decode steps "
                    "/ their wall time (host clock, device synchronized at step boundaries; a step = input "
                    "preparation + CUDA-graph replay + sampling)")
_T0 = time.perf_counter()


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _left(args) -> float:
    return math.inf if args.time_budget is None else args.time_budget - (time.perf_counter() - _T0)


def _say(*a):
    print(*a, flush=True)


# ---- ours -----------------------------------------------------------------------------------------------

def _step_plan(decode_steps: int, cuda: bool) -> list[str]:
    """Mode of each decode step: warm, time, prof (GPU only), eager."""
    d = decode_steps
    eager = min(6, d // 4) if d >= 8 else (1 if d >= 2 else 0)
    prof = min(3, d // 4) if d >= 8 and cuda else 0          # ~10^4 kernels per V3 step: keep the trace small
    warm = 1 if d - eager - prof >= 3 else 0
    timed = d - warm - eager - prof
    return ["warm"] * warm + ["time"] * timed + ["prof"] * prof + ["eager"] * eager


@contextmanager
def _experts_as_moe_gemm():
    """Count the routed experts' GEMMs as family moe_gemm (on the graph-capture path they are plain
    fp8_linear / linear calls, one per expert and projection, inside kernels.moe_experts_static)."""
    import torch.nn.functional as F

    from model import kernels, layers

    orig = layers.Experts.expert
    moe_fp8, moe_lin = kernels._family("moe_gemm", kernels._fp8_linear), kernels._family("moe_gemm", F.linear)

    def expert(self, e, x):
        saved = kernels.fp8_linear, kernels.linear
        kernels.fp8_linear, kernels.linear = moe_fp8, moe_lin
        try:
            return orig(self, e, x)
        finally:
            kernels.fp8_linear, kernels.linear = saved

    layers.Experts.expert = expert
    try:
        yield
    finally:
        layers.Experts.expert = orig


class _Steps:
    """Wraps LLM._decode_step: marks each step's start (device synchronized), switches the profiler on for
    the 'prof' steps and the op-family timing (eager, graph-capture code path) for the 'eager' steps."""

    def __init__(self, llm, plan: list[str]):
        self.llm, self.plan, self.orig = llm, plan, llm._decode_step
        self.marks: list[tuple[str, float]] = []
        self.prof = None
        self.prof_window = None
        self.families: dict = {}

    def __call__(self, seqs):
        from model import kernels

        llm = self.llm
        _sync(llm.device)
        now = time.perf_counter()
        k = len(self.marks)
        mode = self.plan[k] if k < len(self.plan) else "time"
        self.marks.append((mode, now))
        if self.prof is not None and mode != "prof":
            self._stop_profiler(now)
        if mode == "prof" and self.prof is None:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()
            self.prof_t0 = time.perf_counter()
        if mode == "eager":
            llm._op_profile = self.families
            try:
                with kernels.simulated_capture(), _experts_as_moe_gemm():
                    return self.orig(seqs)
            finally:
                llm._op_profile = None
        return self.orig(seqs)

    def _stop_profiler(self, now):
        self.prof.stop()
        self.prof_window = now - self.prof_t0
        self.prof_events = self.prof.events()
        self.prof = None

    def finish(self):
        _sync(self.llm.device)
        now = time.perf_counter()
        if self.prof is not None:
            self._stop_profiler(now)
        self.end = now

    def durations(self) -> list[tuple[str, float]]:
        ends = [t for _, t in self.marks[1:]] + [self.end]
        return [(m, e - t) for (m, t), e in zip(self.marks, ends)]

    def top_kernels(self, n: int = 15) -> list[dict]:
        """The profiled steps' kernels by total time: name, calls and microseconds per step."""
        if self.prof_window is None:
            return []
        from torch.autograd import DeviceType

        steps = max(sum(1 for m, _ in self.marks if m == "prof"), 1)
        acc: dict[str, list[float]] = {}
        for e in self.prof_events:
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
                a = acc.setdefault(e.name, [0.0, 0])
                a[0] += e.time_range.end - e.time_range.start
                a[1] += 1
        top = sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"kernel": k[:120], "us_per_step": t / steps, "calls_per_step": c / steps} for k, (t, c) in top]

    def kernel_share(self):
        """(share, kernels per step, busy seconds) from the profiled steps, or None."""
        if self.prof_window is None:
            return None
        from torch.autograd import DeviceType

        spans = sorted((e.time_range.start, e.time_range.end) for e in self.prof_events
                       if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in spans:                                   # union of intervals (us)
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        n = sum(1 for m, _ in self.marks if m == "prof")
        return busy * 1e-6 / self.prof_window, len(spans) / max(n, 1), busy * 1e-6


def run_ours(args, res: dict) -> list[list[int]]:
    import torch

    from runtime import LLM, SamplingParams

    dtype = getattr(torch, args.dtype) if args.dtype else None
    t = time.perf_counter()
    llm = LLM(args.model_dir, device=args.device, dtype=dtype, max_num_seqs=args.batch,
              max_model_len=args.input_len + args.output_len, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=args.max_num_batched_tokens, keep_fp8=args.keep_fp8)
    ours = res["tilecraft"] = {"device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""),
                               "cuda_graphs": llm.use_cuda_graphs, "keep_fp8": args.keep_fp8,
                               "load_s": time.perf_counter() - t}
    if llm.device.type == "cuda":
        ours["gpu_mem_after_load_gb"] = torch.cuda.memory_allocated(llm.device) / 1e9
    _say(f"[{time.perf_counter() - _T0:6.1f} s] loaded in {ours['load_s']:.1f} s")
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, llm.config.vocab_size, (args.batch, args.input_len), generator=g).tolist()
    t = time.perf_counter()
    warm_len = min(args.input_len, 128)
    llm.generate([p[:warm_len] for p in prompts], SamplingParams(max_tokens=min(2, args.output_len), ignore_eos=True))
    ours["warmup_s"] = time.perf_counter() - t
    _say(f"[{time.perf_counter() - _T0:6.1f} s] warm-up generate (compiles, graph capture) {ours['warmup_s']:.1f} s")
    plan = _step_plan(args.output_len - 1, llm.device.type == "cuda")
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    best = None
    for r in range(args.repeat):
        if r and _left(args) < 120:
            break
        steps = _Steps(llm, plan)
        llm._decode_step = steps
        try:
            llm.generate(prompts, params)
            steps.finish()
        finally:
            del llm._decode_step
        s = llm.stats
        timed = [d for m, d in steps.durations() if m == "time"]
        step_s = sum(timed) / len(timed) if timed else None
        if best is None or (step_s or 0) < (best[1] or 0):
            best = (s, step_s, steps, len(timed))
        _say(f"[{time.perf_counter() - _T0:6.1f} s] timed generate: prefill {s.prefill_s:.2f} s, "
             f"{len(timed)} timed decode steps" + (f" at {1e3 * step_s:.2f} ms" if step_s else ""))
    s, step_s, steps, n_timed = best
    ours.update({
        "prefill_s": s.prefill_s, "prefill_tok_s": s.prefill_tokens / s.prefill_s,
        "decode_steps": s.decode_steps, "timed_steps": n_timed, "decode_step_plan": plan,
        "decode_step_ms": 1e3 * step_s if step_s else None,
        "decode_steps_s": 1 / step_s if step_s else None,
        "decode_tok_s": args.batch / step_s if step_s else None,
    })
    ks = steps.kernel_share()
    if ks:
        ours["kernel_share"], ours["kernels_per_step"], busy = ks
        ours["kernel_share_definition"] = KERNEL_SHARE_DEF
        n_prof = plan.count("prof")
        ours["profiled_step_ms"] = 1e3 * steps.prof_window / n_prof
        ours["kernel_busy_ms_per_step"] = 1e3 * busy / n_prof
        if ours.get("decode_step_ms"):    # the same kernel time over the unprofiled (timed) step
            ours["kernel_share_of_timed_step"] = ours["kernel_busy_ms_per_step"] / ours["decode_step_ms"]
        ours["top_kernels"] = steps.top_kernels()
        if ours["kernels_per_step"] < 10:
            ours["kernel_share_note"] = ("the profiler recorded almost no kernels: CUPTI may not report kernels "
                                         "inside CUDA-graph replays here; rerun with --enforce-eager for a bound")
    eager = [d for m, d in steps.durations() if m == "eager"]
    if eager and steps.families:
        total = sum(eager)
        shares = {k: v[0] / total for k, v in steps.families.items()}
        shares["other (embedding, residual adds, expert mixing, cache writes, sampling, launch gaps)"] = \
            max(0.0, 1 - sum(shares.values()))
        ours["decode_op_shares"] = shares
        ours["decode_op_calls_per_step"] = {k: v[1] / len(eager) for k, v in steps.families.items()}
        ours["eager_step_ms"] = 1e3 * total / len(eager)
    if llm.device.type == "cuda":
        ours["gpu_peak_mem_gb"] = torch.cuda.max_memory_allocated(llm.device) / 1e9
    del llm, steps, best
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return prompts


# ---- transformers ---------------------------------------------------------------------------------------

def _hf_dequantized(model_dir, device, dtype):
    """transformers' DeepseekV3ForCausalLM with our checkpoint's weights, FP8 ones dequantized to dtype
    on the device as they are read (tensor by tensor: bounded host memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from model.reference import fp8_dequantize
    from model.weights import FP8_DTYPE, Checkpoint

    cfg = AutoConfig.from_pretrained(model_dir)
    block = tuple((getattr(cfg, "quantization_config", None) or {}).get("weight_block_size", (128, 128)))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    filled = set()
    ckpt = Checkpoint(model_dir)
    with torch.no_grad():
        for name in ckpt.names():
            if name.endswith("_scale_inv"):
                continue
            t = ckpt.get(name)
            if t.dtype == FP8_DTYPE:
                t = fp8_dequantize(t.to(device), ckpt.get(name[:-len("weight")] + "weight_scale_inv").to(device),
                                   block, torch.float32)
            t = t.to(device)
            if name in params:
                params[name].copy_(t.to(params[name].dtype))
                filled.add(name)
                continue
            # transformers 5 stacks the experts: gate_up_proj (E, 2I, H) = [gate; up], down_proj (E, H, I)
            parts = name.split(".")
            if "experts" in parts and parts[-1] == "weight" and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
                at = parts.index("experts")
                e, prefix = int(parts[at + 1]), ".".join(parts[:at + 1])
                if parts[-2] == "down_proj":
                    params[prefix + ".down_proj"][e].copy_(t)
                    filled.add(prefix + ".down_proj")
                else:
                    w = params[prefix + ".gate_up_proj"]
                    inter = w.shape[1] // 2
                    w[e, :inter].copy_(t) if parts[-2] == "gate_proj" else w[e, inter:].copy_(t)
                    filled.add(prefix + ".gate_up_proj")
                continue
            if not name.startswith(f"model.layers.{cfg.num_hidden_layers}"):   # MTP layers: not in transformers
                raise KeyError(f"transformers' model has no parameter for checkpoint tensor {name!r}")
    missing = [n for n, _ in model.named_parameters() if n not in filled
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise KeyError(f"parameters not in the checkpoint: {missing[:5]}")
    return model


def _hf_load(args, device, dtype, res_hf: dict):
    import torch

    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    if cfg.get("quantization_config") and args.hf_weights in ("auto", "fp8") and device.type == "cuda":
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map=str(device)).eval()
            with torch.inference_mode():
                model(torch.ones(1, 1, dtype=torch.long, device=device))     # FP8 kernels load on first use
            res_hf["weights"] = "fp8 (transformers' FineGrainedFP8, native)"
            return model
        except Exception as e:
            res_hf["fp8_native_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            _say(f"transformers cannot run the FP8 checkpoint natively ({res_hf['fp8_native_error']}); "
                 "dequantizing its weights to bf16 at load instead")
            model = None
        gc.collect()                         # after the except block: its traceback no longer holds the model
        torch.cuda.empty_cache()
        if args.hf_weights == "fp8":
            raise RuntimeError("--hf-weights fp8: " + res_hf["fp8_native_error"])
    if cfg.get("quantization_config"):
        res_hf["weights"] = f"{str(dtype).replace('torch.', '')} (FP8 weights dequantized at load by bench.model)"
        return _hf_dequantized(args.model_dir, device, dtype)
    from transformers import AutoModelForCausalLM

    res_hf["weights"] = str(dtype).replace("torch.", "")
    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()


def _cache_layers(cache):
    """[(layer object, keys attribute name, values attribute name)] of a transformers cache (4.x or 5.x)."""
    if hasattr(cache, "layers"):
        return [(layer, "keys", "values") for layer in cache.layers]
    return None


def _hf_decode(model, args, batch: int, device, dtype, steps: int, warm: int) -> dict:
    """Time `steps` greedy decode steps of transformers at `batch` on a cache of input_len random entries."""
    import torch

    ids = torch.ones(batch, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(ids, use_cache=True)                                  # a 1-token cache: its layout
        cache = out.past_key_values
        layers = _cache_layers(cache)
        if layers is not None:
            for layer, k, v in layers:
                for attr in (k, v):
                    old = getattr(layer, attr)
                    setattr(layer, attr, torch.randn(*old.shape[:2], args.input_len, old.shape[3], device=device,
                                                     dtype=old.dtype))
                    del old
        else:                                                             # transformers 4.x DynamicCache
            for lst in (cache.key_cache, cache.value_cache):
                for i, old in enumerate(lst):
                    lst[i] = torch.randn(*old.shape[:2], args.input_len, old.shape[3], device=device, dtype=old.dtype)
        nxt = out.logits[:, -1:].argmax(-1)
        del out
        for i in range(warm + steps):
            if i == warm:
                _sync(device)
                t0 = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            del out
        _sync(device)
        dt = time.perf_counter() - t0
    del cache
    return {"batch": batch, "context": args.input_len, "decode_steps": steps, "decode_s": dt,
            "decode_step_ms": 1e3 * dt / steps, "decode_steps_s": steps / dt, "decode_tok_s": batch * steps / dt}


def _hf_kv_bytes(cfg: dict, batch: int, tokens: int, elem: int = 2) -> int:
    qk = cfg.get("qk_nope_head_dim", 128) + cfg.get("qk_rope_head_dim", 64)
    return cfg["num_hidden_layers"] * batch * tokens * cfg["num_attention_heads"] * (qk + cfg.get("v_head_dim", 128)) * elem


def run_transformers(args, device, dtype, res: dict) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")                      # no network on the GPU host: fail fast
    import transformers

    res_hf = res["transformers"] = {"version": transformers.__version__}
    t = time.perf_counter()
    model = _hf_load(args, device, dtype, res_hf)
    res_hf["load_s"] = time.perf_counter() - t
    _say(f"[{time.perf_counter() - _T0:6.1f} s] transformers loaded ({res_hf['weights']}) in {res_hf['load_s']:.1f} s")
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    steps, warm = args.hf_steps, 2
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        res_hf["gpu_mem_after_load_gb"] = torch.cuda.memory_allocated(device) / 1e9
        per_layer_extra = 1 + 1.5 / cfg["num_hidden_layers"]            # DynamicCache re-concatenates a layer per step
        batch = args.hf_batch or args.batch
        while args.hf_batch is None and batch > 1 and \
                _hf_kv_bytes(cfg, batch, args.input_len + warm + steps + 1) * per_layer_extra + (6 << 30) > free:
            batch //= 2
    else:
        batch = args.hf_batch or args.batch
    if batch != args.batch:
        res_hf["batch_note"] = (f"batch {args.batch} does not fit: its {args.input_len}-token cache (full per-head "
                                f"keys and values, {_hf_kv_bytes(cfg, args.batch, args.input_len) / 1e9:.0f} GB) "
                                f"next to the weights; measured at batch {batch}")
        _say("transformers: " + res_hf["batch_note"])
    while True:
        try:
            res_hf.update(_hf_decode(model, args, batch, device, dtype, steps, warm))
            break
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            if batch == 1 or _left(args) < 60:
                raise
            batch //= 2
            res_hf["batch_note"] = f"out of memory at larger batches; measured at batch {batch}"
            _say("transformers: " + res_hf["batch_note"])
    res_hf["prefill_note"] = "prefill not run: decode timed on a cache of random keys/values of the prompt length"
    del model
    gc.collect()


# ---- report -------------------------------------------------------------------------------------------

def _fmt(v, spec=".1f"):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def report(res: dict, args) -> None:
    ours, theirs, why_not = res["tilecraft"], res.get("transformers"), res.get("transformers_skipped")
    ok = theirs and theirs.get("decode_tok_s")
    print(f"\nmodel {args.model_dir}: batch {args.batch}, input {args.input_len}, output {args.output_len} "
          f"on {ours['device']} ({ours['dtype']}, keep_fp8 {ours['keep_fp8']}, CUDA graphs "
          f"{'on' if ours['cuda_graphs'] else 'off'})")
    print(f"{'':14s} {'batch':>6s} {'prefill tok/s':>14s} {'decode steps/s':>15s} {'decode tok/s':>13s} {'step ms':>9s}")
    rows = [("tilecraft", ours, args.batch)] + ([("transformers", theirs, theirs["batch"])] if ok else [])
    for name, r, b in rows:
        print(f"{name:14s} {b:6d} {_fmt(r.get('prefill_tok_s')):>14s} {_fmt(r.get('decode_steps_s')):>15s} "
              f"{_fmt(r.get('decode_tok_s')):>13s} {_fmt(r.get('decode_step_ms'), '.2f'):>9s}")
    if ok:
        ratio = res["ratio"] = {k: ours[k] / theirs[k] if ours.get(k) and theirs.get(k) else None
                                for k in ("decode_steps_s", "decode_tok_s")}
        print(f"{'speed ratio':14s} {'':6s} {'-':>14s} {_fmt(ratio['decode_steps_s'], '.2f') + 'x':>15s} "
              f"{_fmt(ratio['decode_tok_s'], '.2f') + 'x':>13s}   (tilecraft / transformers)")
        print(f"transformers weights: {theirs['weights']}; {theirs['prefill_note']}")
        if theirs.get("batch_note"):
            print(f"transformers batch: {theirs['batch_note']}")
    elif why_not:
        print(f"transformers side by side: skipped ({why_not})")
    if "kernel_share" in ours:
        print(f"\nkernel share of decode step time: {100 * ours['kernel_share']:.1f}% "
              f"({ours['kernel_busy_ms_per_step']:.2f} ms of kernels in {ours['profiled_step_ms']:.2f} ms per step, "
              f"{ours['kernels_per_step']:.0f} kernels/step)\n  = {KERNEL_SHARE_DEF}")
        if ours.get("kernel_share_of_timed_step"):
            print(f"  the same kernel time over the timed (unprofiled) step of {ours['decode_step_ms']:.2f} ms: "
                  f"{100 * ours['kernel_share_of_timed_step']:.1f}%")
        if ours.get("kernel_share_note"):
            print("  note: " + ours["kernel_share_note"])
        if ours.get("top_kernels"):
            print("  top kernels per profiled step:")
            for t in ours["top_kernels"]:
                print(f"    {t['us_per_step']:8.1f} us  {t['calls_per_step']:5.1f} x  {t['kernel'][:90]}")
    shares = ours.get("decode_op_shares")
    if shares:
        print(f"\nshare of decode time by op family (eager steps on the graph-capture code path, device synchronized "
              f"around each op; {ours['eager_step_ms']:.1f} ms/step):")
        order = [k for k in FAMILY_ORDER if k in shares] + [k for k in shares if k not in FAMILY_ORDER]
        calls = ours["decode_op_calls_per_step"]
        for k in order:
            extra = f"  ({calls[k]:.0f} calls/step)" if k in calls else ""
            print(f"  {k:14s} {100 * shares[k]:5.1f}%{extra}")


def _write_json(path, res):
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--input-len", type=int, required=True)
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--keep-fp8", action="store_true", help="keep FP8 weights as e4m3 + scales (FP8 GEMMs)")
    ap.add_argument("--moe-path", default=None, choices=("default", "sorted"),
                    help="routed experts' path with --keep-fp8 (model.kernels.MOE_PATH; default: its current value)")
    ap.add_argument("--repeat", type=int, default=1, help="timed generates; the fastest decode is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prompt tokens per prefill step (bounds prefill activations)")
    cmp = ap.add_mutually_exclusive_group()
    cmp.add_argument("--compare", dest="compare", action="store_true", default=None,
                     help="run transformers side by side (default: only on a GPU)")
    cmp.add_argument("--no-compare", dest="compare", action="store_false")
    ap.add_argument("--hf-weights", default="auto", choices=("auto", "fp8", "bf16"),
                    help="transformers on an FP8 checkpoint: auto = native FP8 if it runs, else dequantized")
    ap.add_argument("--hf-batch", type=int, default=None, help="transformers' batch (default: the largest <= --batch "
                                                               "whose cache fits)")
    ap.add_argument("--hf-steps", type=int, default=8, help="transformers' timed decode steps")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole command (see above)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    for name in ("batch", "input_len", "output_len", "repeat", "hf_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"{args.model_dir} has no config.json (make one: python -m model.make_tiny DIR --arch deepseek_v3)")

    import torch

    from bench.op import gpu_name, versions
    from model import kernels

    if args.moe_path is not None:
        kernels.MOE_PATH = args.moe_path

    res = {"meta": {"model_dir": str(args.model_dir), "batch": args.batch, "input_len": args.input_len,
                    "output_len": args.output_len, "keep_fp8": args.keep_fp8, "moe_path": kernels.MOE_PATH, "gpu": gpu_name(), **versions(),
                    "config": json.loads((Path(args.model_dir) / "config.json").read_text())}}
    lock = threading.Lock()
    if args.time_budget is not None:
        def out_of_time():
            with lock:
                res["timed_out"] = f"--time-budget {args.time_budget} s ran out"
                _write_json(args.json, res)
                print(f"\nout of time (--time-budget {args.time_budget} s); partial results:\n"
                      f"{json.dumps({k: v for k, v in res.items() if k != 'meta'}, indent=1, default=str)}",
                      flush=True)
                os._exit(3)

        watchdog = threading.Timer(max(args.time_budget - (time.perf_counter() - _T0), 1), out_of_time)
        watchdog.daemon = True
        watchdog.start()

    prompts = run_ours(args, res)
    _write_json(args.json, res)
    device = torch.device(res["tilecraft"]["device"])
    compare = args.compare if args.compare is not None else device.type == "cuda"
    if not compare:
        res["transformers_skipped"] = "not on a GPU; --compare forces it"
    else:
        ckpt_gb = sum(f.stat().st_size for f in Path(args.model_dir).glob("*.safetensors")) / 1e9
        need = 30 + ckpt_gb / 1.5                                       # load (~1.5 GB/s) + decode, seconds
        if _left(args) < need:
            res["transformers_skipped"] = f"--time-budget: {_left(args):.0f} s left, ~{need:.0f} s needed"
        else:
            try:
                run_transformers(args, device, getattr(torch, res["tilecraft"]["dtype"]), res)
            except Exception as e:  # e.g. out of memory even at batch 1
                res["transformers_skipped"] = f"transformers failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                res.pop("transformers", None)
    del prompts
    with lock:
        report(res, args)
        res["elapsed_s"] = time.perf_counter() - _T0
        _write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
