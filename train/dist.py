"""The one module that touches accelerate and DeepSpeed.

Topology (processes, machines, CPU or GPU) comes from the accelerate config given to
`accelerate launch --config_file configs/accelerate/<x>.yaml`; those files all say
`distributed_type: DEEPSPEED`. ZeRO stage and precision come from the DeepSpeed json named by
`train.deepspeed` (zero2.json by default, zero3.json for stage 3); batch size, accumulation and
clipping are left "auto" there and filled from the train config here. On CPU the process group
is gloo (without it each rank would silently read the whole dataset).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs

from eagle3ft.data.config import TrainConfig, resolve_path


def deepspeed_config(tcfg: TrainConfig, cuda: bool) -> dict:
    """The DeepSpeed json with its precision "auto" resolved from train.precision."""
    path = resolve_path(tcfg.deepspeed)
    if not path.is_file():
        raise FileNotFoundError(f"train.deepspeed: no DeepSpeed config at {path}")
    ds = json.loads(path.read_text())
    precision = tcfg.precision if tcfg.precision != "auto" else ("bf16" if cuda else "fp32")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"train.precision '{tcfg.precision}' is not one of auto, bf16, fp32")
    bf16 = ds.setdefault("bf16", {"enabled": "auto"})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = precision == "bf16"
    fill = {"train_micro_batch_size_per_gpu": tcfg.micro_batch_size, "gradient_accumulation_steps": tcfg.grad_accum, "gradient_clipping": tcfg.max_grad_norm}
    for key, value in fill.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    if ds.get("train_batch_size") == "auto":
        del ds["train_batch_size"]  # DeepSpeed derives it: micro batch x accumulation x world size
    return ds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dist:
    """Process group, DeepSpeed engine and collectives for the training loop."""

    def __init__(self, tcfg: TrainConfig) -> None:
        cuda = torch.cuda.is_available()
        if "LOCAL_RANK" not in os.environ:  # started without a launcher: a world of one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), ACCELERATE_USE_DEEPSPEED="true")
        self.ds_config = deepspeed_config(tcfg, cuda)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        plugin = DeepSpeedPlugin(hf_ds_config=self.ds_config, gradient_accumulation_steps=tcfg.grad_accum, gradient_clipping=tcfg.max_grad_norm)
        handlers = [] if cuda else [InitProcessGroupKwargs(backend="gloo")]
        self.acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=tcfg.grad_accum, kwargs_handlers=handlers)
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        self.print(
            f"distributed: DeepSpeed ZeRO-{self.zero_stage} ({resolve_path(tcfg.deepspeed).name}), {self.world} process(es) on "
            f"{self.device.type}, {str(self.dtype).removeprefix('torch.')}, backend {torch.distributed.get_backend() if self.world > 1 else 'none'}"
        )

    # -- facts

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def world(self) -> int:
        return self.acc.num_processes

    @property
    def is_main(self) -> bool:
        return self.acc.is_main_process

    @property
    def device(self) -> torch.device:
        return self.acc.device

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch that ends an optimizer step."""
        return self.acc.sync_gradients

    # -- setup

    def prepare(self, module, optimizer, scheduler):
        """Wrap the objective module, optimizer and scheduler in the DeepSpeed engine."""
        return self.acc.prepare(module, optimizer, scheduler)

    def prepare_loader(self, loader: torch.utils.data.DataLoader, skip_batches: int = 0):
        """Shard a DataLoader's batches over the ranks (rank r gets batches r, r+W, ...), skipping some on resume."""
        loader = self.acc.prepare_data_loader(loader)
        return self.acc.skip_first_batches(loader, skip_batches) if skip_batches else loader

    def unwrap(self, module):
        return self.acc.unwrap_model(module)

    # -- steps

    def accumulate(self, module):
        return self.acc.accumulate(module)

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    # -- collectives

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.acc.reduce(t.to(self.device), reduction="sum") if self.world > 1 else t

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank."""
        return bool(self.reduce_sum(torch.tensor(float(flag), device=self.device)) > 0)

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list (all ranks receive all lists)."""
        if self.world == 1:
            return [values]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, values)
        return out

    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def print(self, *args) -> None:
        self.acc.print(*args, flush=True)

    # -- state

    def save_state(self, folder: Path) -> None:
        """Optimizer, scheduler, engine and every rank's RNG states (collective: all ranks call it)."""
        self.acc.save_state(str(folder))

    def load_state(self, folder: Path) -> None:
        self.acc.load_state(str(folder))

    def full_state_dict(self, module) -> dict[str, torch.Tensor] | None:
        """The unsharded weights on the main process (collective under ZeRO-3), None elsewhere."""
        sd = self.acc.get_state_dict(module)
        return sd if self.is_main else None

    def end(self) -> None:
        self.acc.end_training()
