"""Benchmark the whole model: prefill and decode throughput, and where decode time goes.

    python -m bench.model MODEL_DIR --batch B --input-len L --output-len N [--repeat 3] [--json out.json]

B random prompts of L tokens each generate N tokens (EOS ignored). Reports prefill tokens/s,
decode steps/s and tokens/s (best of --repeat runs; decode steps replay CUDA graphs on a GPU),
and the share of decode time per op family, measured on a separate eager run that synchronizes
the device around every op (so shares, not absolute times, are the point). On a GPU it also runs
transformers' DeepseekV3ForCausalLM on the same checkpoint (--compare / --no-compare to force)
and prints our speed over theirs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

FAMILY_ORDER = ("gemm", "fp8_gemm", "mla_decode", "mla_prefill", "rms_norm", "rope", "moe_route", "moe_dispatch",
                "moe_gemm", "moe_combine", "act")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(args) -> tuple[dict, list[list[int]]]:
    import torch

    from runtime import LLM, SamplingParams
    from runtime.llm import profile_decode

    dtype = getattr(torch, args.dtype) if args.dtype else None
    llm = LLM(args.model_dir, device=args.device, dtype=dtype, max_num_seqs=args.batch,
              max_model_len=args.input_len + args.output_len, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=max(args.max_num_batched_tokens, args.input_len))
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, llm.config.vocab_size, (args.batch, args.input_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=min(2, args.output_len), ignore_eos=True))   # warm up, capture
    best = None
    for _ in range(args.repeat):
        llm.generate(prompts, params)
        s = llm.stats
        if best is None or s.prefill_s + s.decode_s < best.prefill_s + best.decode_s:
            best = s
    res = {
        "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""), "cuda_graphs": llm.use_cuda_graphs,
        "prefill_s": best.prefill_s, "prefill_tok_s": best.prefill_tokens / best.prefill_s,
        "decode_s": best.decode_s, "decode_steps": best.decode_steps,
        "decode_steps_s": best.decode_steps / best.decode_s if best.decode_steps else None,
        "decode_tok_s": best.decode_tokens / best.decode_s if best.decode_steps else None,
    }
    if args.output_len > 1:
        prof_params = SamplingParams(max_tokens=min(args.output_len, 8), ignore_eos=True)
        families, pstats = profile_decode(llm, prompts, prof_params)
        total = pstats.decode_s
        shares = {k: v[0] / total for k, v in families.items()}
        shares["other (embedding, residual adds, cache writes, sampling, launch gaps)"] = max(0.0, 1 - sum(shares.values()))
        res["decode_op_shares"] = shares
        res["decode_op_calls_per_step"] = {k: v[1] / pstats.decode_steps for k, v in families.items()}
    return res, prompts


def run_transformers(args, prompts, device, dtype) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=min(2, args.output_len), **kw)                   # warm up
        best = None
        for _ in range(args.repeat):
            _sync(device)
            t0 = time.perf_counter()
            model(ids, attention_mask=mask, use_cache=True)
            _sync(device)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kw)
            _sync(device)
            total = time.perf_counter() - t0
            if best is None or total < best[1]:
                best = (prefill, total)
    prefill, total = best
    steps = args.output_len - 1
    decode = max(total - prefill, 1e-9)
    return {"prefill_s": prefill, "prefill_tok_s": args.batch * args.input_len / prefill,
            "decode_s": decode, "decode_steps_s": steps / decode if steps else None,
            "decode_tok_s": args.batch * steps / decode if steps else None}


def _fmt(v, spec=".1f"):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def report(ours: dict, theirs: dict | None, why_not: str | None, args) -> None:
    print(f"model {args.model_dir}: batch {args.batch}, input {args.input_len}, output {args.output_len} "
          f"on {ours['device']} ({ours['dtype']}, CUDA graphs {'on' if ours['cuda_graphs'] else 'off'})")
    print(f"{'':14s} {'prefill tok/s':>14s} {'decode steps/s':>15s} {'decode tok/s':>13s}")
    rows = [("tilecraft", ours)] + ([("transformers", theirs)] if theirs else [])
    for name, r in rows:
        print(f"{name:14s} {_fmt(r['prefill_tok_s']):>14s} {_fmt(r['decode_steps_s']):>15s} {_fmt(r['decode_tok_s']):>13s}")
    if theirs:
        ratio = {k: ours[k] / theirs[k] if ours.get(k) and theirs.get(k) else None
                 for k in ("prefill_tok_s", "decode_steps_s", "decode_tok_s")}
        print(f"{'speed ratio':14s} {_fmt(ratio['prefill_tok_s'], '.2f') + 'x':>14s} "
              f"{_fmt(ratio['decode_steps_s'], '.2f') + 'x':>15s} {_fmt(ratio['decode_tok_s'], '.2f') + 'x':>13s}"
              "   (tilecraft / transformers)")
    elif why_not:
        print(f"transformers side by side: skipped ({why_not})")
    shares = ours.get("decode_op_shares")
    if shares:
        print("\nshare of decode time by op family (eager run, device synchronized around each op):")
        order = [k for k in FAMILY_ORDER if k in shares] + [k for k in shares if k not in FAMILY_ORDER]
        calls = ours["decode_op_calls_per_step"]
        for k in order:
            extra = f"  ({calls[k]:.0f} calls/step)" if k in calls else ""
            print(f"  {k:14s} {100 * shares[k]:5.1f}%{extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--input-len", type=int, required=True)
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs; the fastest is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    cmp = ap.add_mutually_exclusive_group()
    cmp.add_argument("--compare", dest="compare", action="store_true", default=None,
                     help="run transformers side by side (default: only on a GPU)")
    cmp.add_argument("--no-compare", dest="compare", action="store_false")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    for name in ("batch", "input_len", "output_len", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"{args.model_dir} has no config.json (make one: python -m model.make_tiny DIR --arch deepseek_v3)")

    import torch

    ours, prompts = run_ours(args)
    device = torch.device(ours["device"])
    compare = args.compare if args.compare is not None else device.type == "cuda"
    theirs = None
    why_not = None if compare else "not on a GPU; --compare forces it"
    if compare:
        try:
            theirs = run_transformers(args, prompts, device, getattr(torch, ours["dtype"]))
        except Exception as e:  # e.g. an FP8 checkpoint without accelerate, or out of memory
            why_not = f"transformers failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    report(ours, theirs, why_not, args)
    if args.json:
        from bench.op import gpu_name, versions

        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model_dir": str(args.model_dir), "batch": args.batch, "input_len": args.input_len,
                "output_len": args.output_len, "gpu": gpu_name(), **versions()}
        args.json.write_text(json.dumps({"meta": meta, "tilecraft": ours, "transformers": theirs,
                                         "transformers_skipped": why_not}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
