"""The one module that touches accelerate and DeepSpeed.

Topology (processes, machines, CPU or GPU) comes from the accelerate config given to
`accelerate launch --config_file configs/accelerate/<x>.yaml`; those files all say
`distributed_type: DEEPSPEED`. ZeRO stage and precision come from the DeepSpeed json named by
`train.deepspeed` (zero2.json by default, zero3.json for stage 3); batch size, accumulation and
clipping are left "auto" there and filled from the train config here. On CPU the process group
is gloo (without it each rank would silently read the whole dataset).

Training state is read and written here as whole tensors, whatever the number of processes: the
fp32 master weight and the Adam moments of every trainable parameter (DeepSpeed's
`safe_get_full_*` / `safe_set_full_*`, ZeRO 1/2/3), the optimizer's step count and hyper-parameters,
the LR scheduler's state and every rank's RNG states. `train/checkpoint.py` stores them as
safetensors + JSON, so a resume loads no pickle and may use another number of processes.

A launched rank exits when its launcher dies, and on one machine its sockets listen on loopback only
(train/launcher.py). Without a launcher the world of one process needs no socket: its store is in memory.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import InitProcessGroupKwargs

from eagle3ft.config import resolve_path
from eagle3ft.config_train import TrainConfig
from eagle3ft.runlock import RunLocked, check_owner, run_lock
from eagle3ft.train.launcher import clear_stale_build_locks, loopback_only, wait_for_peers_at_exit, watch_launcher


def deepspeed_config(tcfg: TrainConfig, cuda: bool) -> dict:
    """The DeepSpeed json with its precision "auto" resolved from train.precision."""
    path = resolve_path(tcfg.engine.deepspeed)
    if not path.is_file():
        raise FileNotFoundError(f"train.deepspeed: no DeepSpeed config at {path}")
    ds = json.loads(path.read_text())
    precision = tcfg.engine.precision if tcfg.engine.precision != "auto" else ("bf16" if cuda else "fp32")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"train.precision '{tcfg.engine.precision}' is not one of auto, bf16, fp32")
    bf16 = ds.setdefault("bf16", {"enabled": "auto"})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = precision == "bf16"
    fill = {
        "train_micro_batch_size_per_gpu": tcfg.batch.micro_batch_size,
        "gradient_accumulation_steps": tcfg.batch.grad_accum,
        "gradient_clipping": tcfg.optimizer.max_grad_norm,
    }
    for key, value in fill.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    if ds.get("train_batch_size") == "auto":
        del ds["train_batch_size"]  # DeepSpeed derives it: micro batch x accumulation x world size
    return ds


def rng_state() -> dict:
    """This process's RNG states: torch CPU (and CUDA) as uint8 tensors, Python's and NumPy's as plain values."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": {"version": py[0], "state": list(py[1]), "gauss": py[2]},
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if state.get("torch_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dist:
    """Process group, DeepSpeed engine and collectives for the training loop."""

    def __init__(self, tcfg: TrainConfig) -> None:
        cuda = torch.cuda.is_available()
        if "LOCAL_RANK" in os.environ:
            watch_launcher()
        else:  # started without a launcher: a world of one process, whose store is in memory (no socket)
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
                ACCELERATE_USE_DEEPSPEED="true",
            )
        loopback_only()
        if os.environ["LOCAL_RANK"] == "0":
            clear_stale_build_locks()
        if os.environ["WORLD_SIZE"] == "1" and not torch.distributed.is_initialized():
            backend = "nccl" if cuda else "gloo"
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        self.ds_config = deepspeed_config(tcfg, cuda)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        plugin = DeepSpeedPlugin(
            hf_ds_config=self.ds_config,
            gradient_accumulation_steps=tcfg.batch.grad_accum,
            gradient_clipping=tcfg.optimizer.max_grad_norm,
        )
        handlers = [] if cuda else [InitProcessGroupKwargs(backend="gloo")]
        self.acc = Accelerator(
            deepspeed_plugin=plugin, gradient_accumulation_steps=tcfg.batch.grad_accum, kwargs_handlers=handlers
        )
        self.dtype = torch.bfloat16 if self.ds_config["bf16"]["enabled"] else torch.float32
        self.print(
            f"distributed: DeepSpeed ZeRO-{self.zero_stage} ({resolve_path(tcfg.engine.deepspeed).name}), {self.world} "
            "process(es) on "
            f"{self.device.type}, {str(self.dtype).removeprefix('torch.')}, backend "
            f"{torch.distributed.get_backend() if self.world > 1 else 'none'}"
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
        """Wrap the objective module and optimizer in the DeepSpeed engine; the scheduler ticks once per optimizer step.

        (accelerate's own wrapper would tick it once per process per step, so the schedule would depend on the world
        size.)
        """
        self.engine, self.optimizer = self.acc.prepare(module, optimizer)
        self.scheduler = AcceleratedScheduler(scheduler, self.optimizer, split_batches=True)
        return self.engine, self.optimizer, self.scheduler

    def prepare_loader(self, loader: torch.utils.data.DataLoader, skip_batches: int = 0):
        """Shard a DataLoader's batches over the ranks (rank r gets batches r, r+W, ...), skipping some on resume."""
        loader = self.acc.prepare_data_loader(loader)
        return self.acc.skip_first_batches(loader, skip_batches) if skip_batches else loader

    def unwrap(self, module):
        return self.acc.unwrap_model(module)

    # -- steps

    def accumulate(self, module):
        return self.acc.accumulate(module)

    def backward(self, loss: torch.Tensor, between=None) -> None:
        """accelerate's backward under DeepSpeed, in two halves with `between()` called in the middle (the loop's phase
        mark): DeepSpeed's backward (which reduces the gradients under ZeRO-2/3), then, on the micro-batch that ends an
        optimizer step, DeepSpeed's step (clipping, the optimizer, ZeRO's parameter gather)."""
        engine = self.acc.deepspeed_engine_wrapped.engine
        engine.set_gradient_accumulation_boundary(is_boundary=self.sync_gradients)
        engine.backward(loss)
        if between is not None:
            between()
        if self.sync_gradients:
            engine.step()

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

    # -- run lock

    def lock_run(self, run_dir: Path, stage: str = "train"):
        """Rank 0 takes the run folder's lock for the launch; the other ranks check that it holds it (collective)."""
        lock, error = None, ""
        if self.is_main:
            try:
                lock = run_lock(run_dir, stage).acquire()
            except RunLocked as e:
                error = str(e)
        owner = self.gather_objects((socket.gethostname(), os.getpid(), error))[0]
        if owner[2]:
            raise RunLocked(owner[2] if self.is_main else f"rank 0 could not lock {run_dir}")
        if not self.is_main:
            check_owner(run_dir, owner[0], owner[1])
        return lock

    # -- training state (every rank calls these; whole tensors, any world size)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (plain values and CPU tensors), on every rank."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def _zero(self):
        zopt = self.engine.optimizer
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"train.deepspeed: ZeRO stage {self.zero_stage}; checkpoints need ZeRO stage 1, 2 or 3")
        flats = zopt.fp32_partitioned_groups_flat if self.zero_stage == 3 else zopt.single_partition_of_fp32_groups
        return zopt, flats

    def master_partitions(self) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        """(the torch optimizer DeepSpeed steps, this rank's fp32 master partitions that it steps): one flat partition
        per parameter group under ZeRO 1/2, the sub-group partitions under ZeRO-3 (train/l2sp.py)."""
        zopt, flats = self._zero()
        return zopt.optimizer, list(flats)

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict] | tuple[None, None]:
        """(tensors, meta) on the main process, (None, None) elsewhere (collective).

        tensors: `fp32.<param>`, `exp_avg.<param>`, `exp_avg_sq.<param>` (whole, fp32) and `rank<r>.<rng>` for every
        rank.
        meta: optimizer step count and hyper-parameters, scheduler state, engine counters, RNG scalars.
        """
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        zopt, flats = self._zero()
        state = zopt.optimizer.state[flats[0]]
        keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flats[0].shape)
        tensors = {}
        for name, p in self.trainable():
            full = {"fp32": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k) for k in keys}}
            if self.is_main:
                tensors.update({f"{k}.{name}": v.detach().float().cpu().contiguous() for k, v in full.items()})
        rngs = self.gather_objects(rng_state())
        if not self.is_main:
            return None, None
        for r, st in enumerate(rngs):
            tensors[f"rank{r}.torch_cpu"] = st["torch_cpu"]
            if st["torch_cuda"] is not None:
                tensors[f"rank{r}.torch_cuda"] = st["torch_cuda"].cpu()
            tensors[f"rank{r}.numpy_keys"] = st["numpy"]["keys"]
        steps = {float(zopt.optimizer.state[f]["step"]) for f in flats if "step" in zopt.optimizer.state[f]}
        if len(steps) != 1:
            raise RuntimeError(f"optimizer step counts differ between parameter groups: {sorted(steps)}")
        groups = [
            {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
            for g in zopt.optimizer.param_groups
        ]
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return tensors, {
            "optimizer": {
                "class": type(zopt.optimizer).__name__,
                "step": int(steps.pop()),
                "moments": keys,
                "param_groups": groups,
                "params": [n for n, _ in self.trainable()],
            },
            "scheduler": sched,
            "engine": {"global_steps": self.engine.global_steps, "global_samples": self.engine.global_samples},
            "rng": {
                "world_size": len(rngs),
                "python": [st["python"] for st in rngs],
                "numpy": [{k: v for k, v in st["numpy"].items() if k != "keys"} for st in rngs],
            },
        }

    def load_training_state(self, tensors, meta: dict, seed: int) -> str:
        """Restore what `training_state` wrote (`tensors[key]` reads one tensor); returns a note on the RNG restore.

        On another world size, ranks that have no saved RNG state are seeded from (seed, step, rank).
        """
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zopt, flats = self._zero()
        opt = meta["optimizer"]
        inner = zopt.optimizer
        if len(opt["param_groups"]) != len(inner.param_groups):
            raise ValueError(
                f"{len(opt['param_groups'])} optimizer parameter groups saved, {len(inner.param_groups)} now"
            )
        for flat in flats:  # Adam's state is created lazily at the first step: create it now, then fill it
            st = inner.state[flat]
            on_device = any(g.get("capturable") or g.get("fused") for g in inner.param_groups)
            st["step"] = torch.tensor(
                float(opt["step"]), dtype=torch.float32, device=flat.device if on_device else "cpu"
            )
            for k in opt["moments"]:
                st[k] = torch.zeros_like(flat)
        if self.zero_stage in (1, 2):
            zopt._lazy_init_hp_params_optimizer_state()  # links each parameter's fragment of the moments
        for name, p in self.trainable():
            fp32 = tensors[f"fp32.{name}"].to(self.device)
            if (
                self.zero_stage == 3
            ):  # DeepSpeed's safe_set_full_* overrun the last rank's padded partition: fill it here
                for k in (None, *opt["moments"]):
                    part, _ = zopt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=k)
                    src = (fp32 if k is None else tensors[f"{k}.{name}"]).flatten()
                    src = src[part.numel() * zopt._get_param_partition_rank(p) :][: part.numel()]
                    part.data.zero_()
                    part.data[: src.numel()].copy_(src.to(part.device))
            else:
                safe_set_full_fp32_param(p, fp32)
                for k in opt["moments"]:
                    safe_set_full_optimizer_state(p, tensors[f"{k}.{name}"].to(self.device), k)
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=self.zero_stage == 3):
                if self.zero_stage != 3 or self.is_main:
                    p.data.copy_(fp32.to(p.dtype))
        for g, saved in zip(inner.param_groups, opt["param_groups"]):
            g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(meta["scheduler"]["base_lrs"])})
        self.engine.global_steps = meta["engine"]["global_steps"]
        self.engine.global_samples = meta["engine"]["global_samples"]
        rng = meta["rng"]
        saved_world, r = rng["world_size"], self.rank
        if r < saved_world:
            cuda = f"rank{r}.torch_cuda"
            set_rng_state(
                {
                    "torch_cpu": tensors[f"rank{r}.torch_cpu"],
                    "torch_cuda": tensors[cuda] if cuda in tensors else None,
                    "python": rng["python"][r],
                    "numpy": {"keys": tensors[f"rank{r}.numpy_keys"], **rng["numpy"][r]},
                }
            )
        else:
            mixed = seed * 1_000_003 + opt["step"] * 1009 + r
            torch.manual_seed(mixed)
            random.seed(mixed)
            np.random.seed(mixed % 2**32)
        if saved_world == self.world:
            return f"RNG states of all {self.world} rank(s) restored"
        if self.world < saved_world:
            return f"RNG states of ranks 0..{self.world - 1} of {saved_world} restored"
        return (
            f"RNG states of ranks 0..{saved_world - 1} restored, ranks {saved_world}..{self.world - 1} seeded from "
            "(seed, step, rank)"
        )

    def full_state_dict(self, module) -> dict[str, torch.Tensor] | None:
        """The unsharded weights on the main process (collective under ZeRO-3), None elsewhere."""
        sd = self.acc.get_state_dict(module)
        return sd if self.is_main else None

    def end(self) -> None:
        """Tear down in an order that leaves nothing running when a rank exits (train/launcher.py's exit_rank then
        os._exits).

        1. DeepSpeed's engine (its hooks, ZeRO-3's parameter coordinator and in-flight gathers) and the accelerator's
           references go and are collected while every peer is still up: none of it is freed after the process group.
        2. A barrier: gloo's waits for every earlier collective of this rank, so no gloo work is pending.
        3. The process groups go (gloo's worker threads joined, its pairs closed) on every rank.
        4. A launch of several processes keeps the launcher's store, through which exit_rank waits for every rank to
           get here: a rank that os._exits while its peer still destroys its process group or frees the engine closes
           sockets the peer uses, and can make it abort in C++ ("terminate called without an active exception" from
           rank 1 of the ZeRO-3 CPU launch; benchmarks/leases/exit_abort_loop.sh counts it)."""
        self.acc.free_memory()
        gc.collect()
        self.acc.wait_for_everyone()
        store = torch.distributed.distributed_c10d._get_default_store() if self.world > 1 else None
        self.acc.end_training()
        if store is not None:
            wait_for_peers_at_exit(store, self.rank, self.world)
