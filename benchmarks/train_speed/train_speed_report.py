"""train_speed.py's output: number formats, versions and device, the summary rows, the JSON file and the printed
table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time

from train_speed_measure import Side


def fmt_flop(x: float, unit: float) -> str:
    return f"{x / unit:,.3f}"


def flop_unit(x: float) -> tuple[float, str]:
    return (1e9, "GFLOP") if x >= 1e9 else (1e6, "MFLOP")


def fmt_rate(r: float) -> str:
    return f"{r / 1e12:.1f} TFLOP/s" if r >= 1e12 else f"{r / 1e9:.1f} GFLOP/s"


def versions() -> dict:
    """Library versions, and content hashes of our train code (the device copy has no .git)."""
    import hashlib

    out = {"python": platform.python_version()}
    try:
        from eagle3ft.drafter import model
        from eagle3ft.train import attention, losses, ttt

        for mod in (model, ttt, attention, losses):
            with open(mod.__file__, "rb") as f:
                out[f"sha256[{os.path.basename(mod.__file__)}]"] = hashlib.sha256(f.read()).hexdigest()[:12]
    except Exception:
        pass
    for name in ("torch", "transformers", "triton", "specforge", "eagle3ft"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:
            out[name] = None
    return out


def gpu_info(torch, device) -> dict:
    if device.type != "cuda":
        return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    info = {
        "gpu": torch.cuda.get_device_name(device),
        "total_memory_GiB": torch.cuda.get_device_properties(device).total_memory / 2**30,
    }
    try:
        q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,driver_version"
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception as e:  # nvidia-smi is optional
        info["nvidia_smi"] = f"unavailable ({e.__class__.__name__})"
    return info


def summarize(a, sides: list[Side], flops: dict, rate: float, tokens: int, device) -> list[dict]:
    rows = []
    for s in sides:
        if not s.times_ms:
            continue
        med = statistics.median(s.times_ms)
        tps = tokens / (med / 1e3)
        rows.append(
            {
                "side": s.name,
                "notes": s.notes,
                "step_ms_median": med,
                "step_ms_min": min(s.times_ms),
                "step_ms_max": max(s.times_ms),
                "tokens_per_s": tps,
                "tokens_per_s_min": tokens / (max(s.times_ms) / 1e3),
                "tokens_per_s_max": tokens / (min(s.times_ms) / 1e3),
                "mfu": tps * flops["train_per_token"] / rate,
                "extra_flops_per_token": s.extra_flops_per_token,
                "peak_GiB": s.peak_bytes / 2**30 if device.type == "cuda" else None,
                "resident_GiB": s.resident_bytes / 2**30 if device.type == "cuda" else None,
                "loss_first": s.losses[0],
                "loss_last": s.losses[-1],
                "timed_steps": len(s.times_ms),
                "step_ms_all": s.times_ms,
            }
        )
    base = next((r for r in rows if r["side"].startswith("theirs")), rows[0] if rows else None)
    for r in rows:
        r["base"] = base["side"] if base else None
        r["speedup_vs_base"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["peak_vs_base"] = (r["peak_GiB"] / base["peak_GiB"]) if base and base["peak_GiB"] else None
    return rows


def write_json(
    a, rows, flops, rate, shared, batch_bytes, device, torch, t_start, rounds_done, failed, profiles
) -> None:
    if not a.out:
        return
    result = {
        "args": vars(a),
        "flops": flops,
        "matmul_rate_flops": rate,
        "versions": versions(),
        "device": gpu_info(torch, device),
        "synthetic_teacher": shared["info"],
        "shared_inputs_GiB": batch_bytes / 2**30,
        "rounds_done": rounds_done,
        "results": rows,
        "failed": failed,
        "profiles": profiles,
        "wall_s": time.time() - t_start,
        "timing": "CUDA events around each step, synchronize after each" if device.type == "cuda" else "perf_counter",
        "memory": "peak = resident (params, optimizer state, buffers after warm-up) + max allocated above the start of "
        "the side's timed steps; shared inputs excluded"
        if device.type == "cuda"
        else "not measured on the CPU",
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"train_speed{'_' + a.tag if a.tag else ''}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def print_table(a, rows, flops, rate, tokens, rounds_done, failed) -> None:
    print(
        f"\n## train step, {tokens} tokens/step, {rounds_done} round(s) x {a.steps} timed steps per side, interleaved; "
        f"MFU vs {fmt_rate(rate)} measured and {flops['train_per_token'] / 1e9:.3f} GFLOP/token (GUIDE section 5)"
    )
    hdr = (
        f"{'side':<34} {'step ms median [min-max]':<28} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'resident':>9} "
        f"{'vs base':>8} {'loss first->last':>18}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sp = f"{r['speedup_vs_base']:.2f}x" if r["speedup_vs_base"] is not None else "n/a"
        peak = f"{r['peak_GiB']:.1f}" if r["peak_GiB"] is not None else "n/a"
        res = f"{r['resident_GiB']:.1f}" if r["resident_GiB"] is not None else "n/a"
        ms = f"{r['step_ms_median']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}]"
        print(
            f"{r['side']:<34} {ms:<28} {r['tokens_per_s']:>9.0f} {100 * r['mfu']:>5.1f}% {peak:>9} {res:>9} {sp:>8} "
            f"{r['loss_first']:>8.4f}->{r['loss_last']:.4f}"
        )
    for name, why in failed.items():
        print(f"{name:<34} FAILED: {why}")
    if rows and rows[0]["base"]:
        goal = (
            "; goal: ours >= 1.5x base tokens/s, >= 50% MFU, peak <= base peak"
            if rows[0]["base"].startswith("theirs")
            else ""
        )
        print(f"base = {rows[0]['base']}{goal}")
