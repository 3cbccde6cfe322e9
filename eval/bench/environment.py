"""What a bench records about the machine it ran on: CPU, GPU clocks (nvidia-smi), library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from eagle3ft.cli import code_version


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_clocks() -> list[dict] | None:
    """nvidia-smi's view of each GPU (clocks, power), or None without nvidia-smi."""
    fields = (
        "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,power.limit,temperature.gpu,driver_version"
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    keys = fields.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in out.stdout.strip().splitlines()]


def base_environment(device: torch.device | str | None = None) -> dict:
    import transformers

    dev = torch.device(device) if device is not None else torch.device("cpu")
    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu: {cpu_model()}",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "code_version": code_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if dev.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["nvidia_smi"] = gpu_clocks()
    return env
