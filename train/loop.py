"""The fine-tuning loop: feature store -> TTT unroll -> checkpoints, export and metrics.

`main(cfg, run_dir)` is what `train/finetune.py` calls under `accelerate launch`; every rank runs it.
Reads `run_dir/features` and `run_dir/vocab.safetensors` (or the warm-start drafter's own vocab);
writes `run_dir/ckpt/step-N/`, `run_dir/export/` and `run_dir/train/metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3ft.data.config import Config, TrainConfig, resolve_path, to_dict
from eagle3ft.data.drafter_spec import default_aux_layer_ids
from eagle3ft.data.store import FeatureStore, StoreError, collate
from eagle3ft.data.vocab import check_vocab, load_vocab
from eagle3ft.train.checkpoint import atomic_dir, drafter_tensors, load_checkpoint, load_drafter, resume_path, save_checkpoint, write_drafter
from eagle3ft.train.model import Eagle3Config, Eagle3Drafter
from eagle3ft.train.ttt import TTTObjective


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; names the step and the samples of the batch."""


class OutOfMemoryHint(RuntimeError):
    """Device out of memory, re-raised with what to change."""


OOM_HINT = (
    "CUDA out of memory during drafter training. Lower train.micro_batch_size or train.max_len, "
    "use fewer train.ttt_steps, or shard more with --set train.deepspeed=configs/deepspeed/zero3.json; "
    "`python -m eagle3ft.train.estimate` prints the expected per-GPU memory."
)


@contextmanager
def oom_hint():
    """Turn a CUDA out-of-memory error into OutOfMemoryHint (the original chained)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise OutOfMemoryHint(f"{OOM_HINT}\n({str(e).splitlines()[0]})") from e


# --------------------------------------------------------------------------- setup


def check_against_target(dcfg: Eagle3Config, target: dict, where: str) -> None:
    """Refuse a drafter whose hidden size, vocab size or aux layer ids disagree with the features."""
    if dcfg.target_hidden_size != target["hidden_size"]:
        raise ValueError(f"{where}: drafter target_hidden_size {dcfg.target_hidden_size} != features' target hidden_size {target['hidden_size']}")
    if dcfg.vocab_size != target["vocab_size"]:
        raise ValueError(f"{where}: drafter vocab_size {dcfg.vocab_size} != features' target vocab_size {target['vocab_size']}")
    ids = dcfg.aux_layer_ids if dcfg.aux_layer_ids is not None else default_aux_layer_ids(target["num_layers"])
    if list(ids) != list(target["aux_layer_ids"]):
        raise ValueError(f"{where}: drafter aux layer ids {list(ids)} != features' aux layer ids {list(target['aux_layer_ids'])}")


def build_drafter(cfg: Config, run_dir: Path, target: dict) -> Eagle3Drafter:
    """Scratch (architecture json + the run's vocab) or warm start (a drafter folder, its own d2t/t2d)."""
    from eagle3ft.data.targets.hf import load_input_embedding

    if cfg.drafter.init:
        folder = resolve_path(cfg.drafter.init)
        check_against_target(Eagle3Config.from_json(folder / "config.json"), target, f"warm start {folder}")
        model = load_drafter(folder, load_input_embedding(cfg.target))
        if cfg.drafter.draft_vocab_size not in (None, model.config.draft_vocab_size):
            raise ValueError(f"drafter.draft_vocab_size {cfg.drafter.draft_vocab_size} != warm-start drafter's {model.config.draft_vocab_size} (its vocab is kept)")
        return model.float()
    dcfg = Eagle3Config.from_json(resolve_path(cfg.drafter.config))
    if cfg.drafter.draft_vocab_size:
        dcfg.draft_vocab_size = cfg.drafter.draft_vocab_size
    check_against_target(dcfg, target, str(cfg.drafter.config))
    vocab_file = run_dir / "vocab.safetensors"
    if not vocab_file.is_file():
        raise FileNotFoundError(f"{vocab_file} not found: the harvest writes it (python data/harvest.py ... --run-dir {run_dir})")
    d2t, t2d = load_vocab(vocab_file)
    check_vocab(d2t, t2d, dcfg.vocab_size, dcfg.draft_vocab_size)
    model = Eagle3Drafter(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_input_embedding(cfg.target))
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


def target_head(cfg: Config, store: FeatureStore, model: Eagle3Drafter) -> torch.Tensor | None:
    """The target lm_head rows of the draft vocab when p comes from last_hidden, else None."""
    source = cfg.train.target_source
    if source not in ("auto", "topk", "last_hidden"):
        raise ValueError(f"train.target_source '{source}' is not one of auto, topk, last_hidden")
    has = store.manifest.get("has_last_hidden", False)
    if source == "last_hidden" and not has:
        raise StoreError(f"train.target_source is last_hidden but {store.dir} has no last_hidden (harvest.store_last_hidden)")
    if source == "topk" or not has:
        return None
    from eagle3ft.data.targets.hf import load_output_head

    ids = torch.arange(model.config.draft_vocab_size) + model.d2t
    return load_output_head(cfg.target)[ids].float()


class EpochOrder(torch.utils.data.Dataset):
    """The dataset in a seeded per-epoch order (the same on every rank)."""

    def __init__(self, ds, seed: int, epoch: int) -> None:
        self.ds = ds
        self.order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[self.order[i]]


def lr_lambda(tcfg: TrainConfig, total: int):
    """Linear warm-up, then cosine down to min_lr_ratio at `total` steps."""

    def f(step: int) -> float:
        if step < tcfg.warmup_steps:
            return (step + 1) / tcfg.warmup_steps
        frac = min(1.0, (step - tcfg.warmup_steps) / max(1, total - tcfg.warmup_steps))
        return tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


# --------------------------------------------------------------------------- the loop


def main(cfg: Config, run_dir: str | Path) -> dict:
    """Fine-tune the drafter on run_dir/features; returns the last metrics record."""
    from eagle3ft.train.dist import Dist

    run_dir = Path(run_dir)
    tcfg = cfg.train
    store = FeatureStore(run_dir / "features")
    train_set = store.dataset("train")
    if len(train_set) == 0:
        raise StoreError(f"{store.dir}: no training samples (the train split is empty)")
    torch.manual_seed(cfg.seed)
    model = build_drafter(cfg, run_dir, store.target)
    if tcfg.compile:
        model.compile_blocks()
    objective = TTTObjective(model, tcfg.ttt_steps, tcfg.step_decay, target_head(cfg, store, model))

    dist = Dist(tcfg)
    batches_per_epoch = math.ceil(len(train_set) / (tcfg.micro_batch_size * dist.world))
    steps_per_epoch = math.ceil(batches_per_epoch / tcfg.grad_accum)
    total = tcfg.max_steps or tcfg.epochs * steps_per_epoch
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg, total))
    engine, optimizer, scheduler = dist.prepare(objective, optimizer, scheduler)

    step, epoch, batch_in_epoch = 0, 0, 0
    ckpt = resume_path(run_dir, tcfg.resume)
    if ckpt is not None:
        st = load_checkpoint(dist, ckpt)
        step, epoch, batch_in_epoch = st["step"], st["epoch"], st["batch_in_epoch"]
        dist.print(f"resumed from {ckpt} at step {step} (epoch {epoch}, micro-batch {batch_in_epoch})")

    log_dir = run_dir / "train"
    metrics_file = log_dir / "metrics.jsonl"
    wandb_run = None
    if dist.is_main:
        log_dir.mkdir(parents=True, exist_ok=True)
        n_train = sum(p.numel() for p in trainable)
        start = f"warm start from {resolve_path(cfg.drafter.init)}" if cfg.drafter.init else "from scratch"
        dist.print(f"drafter: {n_train / 1e6:.1f}M trainable parameters, {start}; {len(train_set)} training samples; {total} optimizer steps")
        if tcfg.wandb_mode != "disabled":
            import wandb

            wandb_run = wandb.init(project=tcfg.wandb_project, name=cfg.run_name, mode=tcfg.wandb_mode, dir=str(log_dir), config=to_dict(cfg), resume="allow")

    def trainer_state() -> dict:
        return {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "total_steps": total, "config": to_dict(cfg), "last": last}

    K = tcfg.ttt_steps
    stats = torch.zeros(5, K, device=dist.device)
    tokens, micro, last, step_samples = 0, 0, {}, []
    t_log = time.perf_counter()
    start_step = step
    bar = tqdm(total=total, initial=step, desc="train", disable=not dist.is_main, dynamic_ncols=True)
    stop = step >= total
    while not stop:
        loader = torch.utils.data.DataLoader(
            EpochOrder(train_set, cfg.seed, epoch), batch_size=tcfg.micro_batch_size, shuffle=False,
            collate_fn=partial(collate, max_len=tcfg.max_len), num_workers=tcfg.num_workers, pin_memory=torch.cuda.is_available(),
        )
        for batch in dist.prepare_loader(loader, skip_batches=batch_in_epoch):
            sample_ids = batch.pop("sample_id").tolist()
            step_samples += sample_ids
            batch = {k: v.to(dist.device) for k, v in batch.items()}
            with oom_hint(), dist.accumulate(engine):
                out = engine(batch)
                if dist.any(not bool(torch.isfinite(out.loss))):
                    bad = dist.gather_ints(sample_ids if not torch.isfinite(out.loss) else [])
                    raise NonFiniteLoss(f"non-finite loss at step {step + 1} (epoch {epoch}, micro-batch {batch_in_epoch}); sample ids per rank: {bad}")
                lr = scheduler.get_last_lr()[0]  # the rate this step applies
                dist.backward(out.loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            stats += torch.stack([out.step_loss, out.correct, out.valid, out.chain_correct, out.chain_valid]).detach()
            tokens += int(batch["attention_mask"].sum())
            micro += 1
            batch_in_epoch += 1
            if not dist.sync_gradients:
                continue
            step += 1
            samples = dist.gather_ints(step_samples)  # every rank's samples of this optimizer step
            step_samples = []
            if step % tcfg.log_every == 0 or step == total:
                s = dist.reduce_sum(stats)
                n_tok = int(dist.reduce_sum(torch.tensor(float(tokens), device=dist.device)))
                n_micro = int(dist.reduce_sum(torch.tensor(float(micro), device=dist.device)))
                dt = time.perf_counter() - t_log
                acc = (s[1] / s[2].clamp(min=1)).tolist()
                cond = (s[3] / s[4].clamp(min=1)).tolist()
                step_loss = (s[0] / max(n_micro, 1)).tolist()
                last = {
                    "step": step, "epoch": epoch,
                    "loss": sum(tcfg.step_decay**k * step_loss[k] for k in range(K)),
                    "step_loss": step_loss, "acc": acc, "cond_acc": cond,
                    "accept_len_est": 1 + sum(math.prod(cond[: k + 1]) for k in range(K)),
                    "lr": lr, "samples": samples, "tokens": n_tok, "tokens_per_s": n_tok / dt, "s_per_step": dt / tcfg.log_every,
                }
                if dist.is_main:
                    with open(metrics_file, "a") as f:
                        f.write(json.dumps(last) + "\n")
                    if wandb_run is not None:
                        flat = {k: v for k, v in last.items() if not isinstance(v, list)}
                        flat.update({f"{name}/{k}": x for name in ("step_loss", "acc", "cond_acc") for k, x in enumerate(last[name])})
                        wandb_run.log(flat, step=step)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
                stats.zero_()
                tokens, micro, t_log = 0, 0, time.perf_counter()
            bar.update(1)
            done = step >= total or (tcfg.stop_after is not None and step - start_step >= tcfg.stop_after)
            if step % tcfg.save_every == 0 or done:
                save_checkpoint(dist, engine, model.config, run_dir, step, trainer_state(), tcfg.keep_checkpoints)
            if done:
                stop = True
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
    bar.close()
    if step >= total and (step > start_step or not (run_dir / "export").exists()):
        state = dist.full_state_dict(engine)
        if dist.is_main:
            with atomic_dir(run_dir / "export") as tmp:
                write_drafter(tmp, model.config, drafter_tensors(state, prefix="drafter."))
            dist.print(f"exported the drafter to {run_dir / 'export'} (SGLang: --speculative-draft-model-path {run_dir / 'export'})")
        dist.barrier()
    if wandb_run is not None:
        wandb_run.finish()
    dist.end()
    return last
