"""The fine-tuning loop: feature store -> TTT unroll -> checkpoints, export and metrics.

`main(cfg, run_dir)` is what `train/finetune.py` calls under `accelerate launch`; every rank runs it.
Reads `run_dir/features` and `run_dir/vocab.safetensors` (or the warm-start drafter's own vocab); with
`train.features: online`, `run_dir/tokens` and the target's own prefill instead (batches: train/data.py);
writes `run_dir/ckpt/step-N/`, `run_dir/export/` (the last step), `run_dir/export-best/` (the best step by held-out τ,
train/validate.py; each export's card.json says which step it is) and `run_dir/train/metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3ft.data.config import Config, TrainConfig, resolve_path, to_dict
from eagle3ft.data.drafter_spec import check_drafter, check_drafter_folder
from eagle3ft.data.store import StoreError
from eagle3ft.data.vocab import load_vocab, save_vocab
from eagle3ft.train.checkpoint import atomic_dir, drafter_tensors, load_checkpoint, load_drafter, resume_path, resume_position, save_checkpoint, truncate_metrics, write_drafter
from eagle3ft.train.data import TrainData
from eagle3ft.train.model import Eagle3Config, Eagle3Drafter
from eagle3ft.train.ttt import TTTObjective
from eagle3ft.train.validate import HeldoutTracker, read_card, write_card


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


def build_drafter(cfg: Config, run_dir: Path, target: dict) -> Eagle3Drafter:
    """Scratch (architecture json + the run's vocab) or warm start (a drafter folder, its own d2t/t2d).

    `target` is the features' identity; check_drafter refuses a drafter that disagrees with it before any compute.
    """
    from eagle3ft.data.targets.hf import load_input_embedding

    features = str(run_dir / "features" / "manifest.json")
    if cfg.drafter.init:
        folder = resolve_path(cfg.drafter.init)
        spec = check_drafter_folder(folder, target, "warm start", features)
        if cfg.drafter.draft_vocab_size not in (None, spec.draft_vocab_size):
            raise ValueError(f"drafter.draft_vocab_size {cfg.drafter.draft_vocab_size} != warm-start drafter's {spec.draft_vocab_size} (its vocab is kept)")
        layout = Eagle3Config.from_spec(spec)
        for flag in ("fc_norm", "norm_output"):  # EAGLE-3.1 options change what the trained weights mean
            if getattr(cfg.drafter, flag) not in (None, getattr(layout, flag)):
                raise ValueError(f"drafter.{flag} {getattr(cfg.drafter, flag)} != warm-start drafter's {getattr(layout, flag)} ({folder}/config.json; its layout is kept)")
        return load_drafter(folder, load_input_embedding(cfg.target)).float()
    dcfg = Eagle3Config.from_json(resolve_path(cfg.drafter.config))
    if cfg.drafter.draft_vocab_size:
        dcfg.draft_vocab_size = cfg.drafter.draft_vocab_size
    for flag in ("fc_norm", "norm_output"):
        if getattr(cfg.drafter, flag) is not None:
            setattr(dcfg, flag, getattr(cfg.drafter, flag))
    check_drafter(dcfg, target, str(cfg.drafter.config), features)
    vocab_file = run_dir / "vocab.safetensors"
    if not vocab_file.is_file():
        raise FileNotFoundError(f"{vocab_file} not found: the harvest writes it (python data/harvest.py ... --run-dir {run_dir})")
    d2t, t2d = load_vocab(vocab_file)
    check_drafter(dcfg, target, str(vocab_file), features, d2t, t2d)
    model = Eagle3Drafter(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_input_embedding(cfg.target))
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


def adopt_drafter_vocab(run_dir: Path, d2t: torch.Tensor, t2d: torch.Tensor, folder: Path) -> str | None:
    """After a warm start the run's vocab.safetensors is the drafter's: rewrite it when it differs (or is
    missing or unreadable) and return what was done, so the run folder never holds two vocabularies."""
    vocab_file = run_dir / "vocab.safetensors"
    d2t, t2d = d2t.cpu().to(torch.int64), t2d.cpu().to(torch.bool)
    try:
        old = load_vocab(vocab_file) if vocab_file.is_file() else None
    except ValueError as e:
        old, why = None, f"was unreadable ({e})"
    else:
        why = "was missing"
    if old is not None:
        if old[0].shape == d2t.shape and old[1].shape == t2d.shape:
            n_d2t, n_t2d = int((old[0] != d2t).sum()), int((old[1] != t2d).sum())
            if n_d2t == 0 and n_t2d == 0:
                return None
            why = f"differed from it in {n_d2t} of {d2t.numel()} d2t and {n_t2d} of {t2d.numel()} t2d entries"
        else:
            why = f"had {old[0].numel()} draft tokens, the drafter {d2t.numel()}"
    tmp = vocab_file.with_name(f".{vocab_file.name}.tmp")
    save_vocab(tmp, d2t, t2d)
    os.replace(tmp, vocab_file)
    return f"{vocab_file} {why}; rewrote it with the warm-start drafter's d2t/t2d ({folder}), which its lm_head rows follow"


def target_head(cfg: Config, data: TrainData, model: Eagle3Drafter) -> torch.Tensor | None:
    """The target lm_head rows of the draft vocab when p comes from last_hidden, else None."""
    source = cfg.train.target_source
    if source not in ("auto", "topk", "last_hidden"):
        raise ValueError(f"train.target_source '{source}' is not one of auto, topk, last_hidden")
    has = data.has_last_hidden
    if source == "last_hidden" and not has:
        raise StoreError(f"train.target_source is last_hidden but {data.where} has no last_hidden (harvest.store_last_hidden)")
    if source == "topk" or not has:
        return None
    from eagle3ft.data.targets.hf import load_output_head

    ids = torch.arange(model.config.draft_vocab_size) + model.d2t
    return load_output_head(cfg.target)[ids].float()


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
    """Fine-tune the drafter on run_dir's features (or the target's, online: train/data.py); returns the last metrics record."""
    from eagle3ft.train.dist import Dist

    run_dir = Path(run_dir)
    tcfg = cfg.train
    data = TrainData(cfg, run_dir)
    torch.manual_seed(cfg.seed)
    model = build_drafter(cfg, run_dir, data.target)
    if tcfg.compile:
        model.compile_blocks()
    objective = TTTObjective(model, tcfg.ttt_steps, tcfg.step_decay, target_head(cfg, data, model), tcfg.loss, tcfg.lk_eta)

    dist = Dist(tcfg)
    lock = dist.lock_run(run_dir)
    if cfg.drafter.init and dist.is_main:
        note = adopt_drafter_vocab(run_dir, model.d2t, model.t2d, resolve_path(cfg.drafter.init))
        if note:
            dist.print(note)
    total = tcfg.max_steps or sum(math.ceil(math.ceil(data.micro_batches(e) / dist.world) / tcfg.grad_accum) for e in range(tcfg.epochs))
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg, total))
    engine, optimizer, scheduler = dist.prepare(objective, optimizer, scheduler)

    step, epoch, batch_in_epoch = 0, 0, 0
    ckpt = resume_path(run_dir, tcfg.resume)
    if ckpt is not None:
        st, rng_note = load_checkpoint(dist, ckpt, cfg.seed)
        step = st["step"]
        epoch, batch_in_epoch = resume_position(st, ckpt, data.order_len(st.get("data", {}).get("epoch", 0)), data.per_micro_batch, dist.world)
        dist.print(f"resumed from {ckpt} at step {step} (epoch {epoch}, {st['data']['samples_in_epoch']} samples of its order consumed; written by {st['world_size']} process(es), now {dist.world}; {rng_note})")
        if st["total_steps"] != total:
            dist.print(f"note: {total} optimizer steps now, {st['total_steps']} when the checkpoint was written (set train.max_steps to keep the LR schedule)")
    heldout = HeldoutTracker(run_dir, data.heldout(dist.device), cfg, dist, resumed=ckpt is not None)

    log_dir = run_dir / "train"
    metrics_file = log_dir / "metrics.jsonl"
    wandb_run = None
    if dist.is_main:
        log_dir.mkdir(parents=True, exist_ok=True)
        if dropped := truncate_metrics(metrics_file, step):
            dist.print(f"{metrics_file}: dropped {dropped} record(s) past step {step}")
        n_train = sum(p.numel() for p in trainable)
        start = f"warm start from {resolve_path(cfg.drafter.init)}" if cfg.drafter.init else "from scratch"
        dist.print(f"drafter: {n_train / 1e6:.1f}M trainable parameters, {start}; {len(data)} training samples ({tcfg.features}{f', packed in {tcfg.pack_tokens}-token rows' if tcfg.pack_tokens else ''}); {total} optimizer steps")
        if tcfg.wandb_mode != "disabled":
            import wandb

            wandb_run = wandb.init(project=tcfg.wandb_project, name=cfg.run_name, mode=tcfg.wandb_mode, dir=str(log_dir), config=to_dict(cfg), resume="allow")

    def trainer_state() -> dict:
        n_order = data.order_len(epoch)  # samples, or bins when packed
        consumed = min(n_order, batch_in_epoch * dist.world * data.per_micro_batch)  # of the epoch's seeded order
        return {
            "step": step, "data": {"epoch": epoch, "samples_in_epoch": consumed, "n_train": n_order}, "world_size": dist.world,
            "micro_batch_size": tcfg.micro_batch_size, "grad_accum": tcfg.grad_accum, "total_steps": total, "config": to_dict(cfg), "last": last,
        }

    K = tcfg.ttt_steps
    stats = torch.zeros(5, K, device=dist.device)
    tokens, micro, last, step_samples = 0, 0, {}, []
    t_log = time.perf_counter()
    start_step = step
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not dist.is_main, dynamic_ncols=True)  # ETA from the step rate
    stop = step >= total
    while not stop:
        for micro_batch in data.epoch(dist, epoch, skip=batch_in_epoch):
            batch, sample_ids = micro_batch.tensors, micro_batch.sample_ids
            step_samples += sample_ids
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
            tokens += micro_batch.tokens  # real tokens, padding excluded
            micro += 1
            batch_in_epoch += 1
            if not dist.sync_gradients:
                continue
            step += 1
            samples = dist.gather_ints(step_samples)  # every rank's samples of this optimizer step
            step_samples = []
            eval_now = heldout.due(step, total)
            if step % tcfg.log_every == 0 or step == total or eval_now:
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
                    "max_mem_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30 if dist.device.type == "cuda" else None,
                }
                if eval_now:
                    last.update(heldout.run(engine, model.config, step))
                if dist.is_main:
                    with open(metrics_file, "a") as f:
                        f.write(json.dumps(last) + "\n")
                    if wandb_run is not None:
                        flat = {k: v for k, v in last.items() if not isinstance(v, list)}
                        flat.update({f"{name}/{k}": x for name in ("step_loss", "acc", "cond_acc", "heldout_cond_acc") if name in last for k, x in enumerate(last[name])})
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
                write_card(tmp, "last", step, heldout.latest, heldout.depth)
            dist.print(f"exported the drafter to {run_dir / 'export'} (SGLang: --speculative-draft-model-path {run_dir / 'export'})")
            if heldout.latest is not None:
                best = read_card(run_dir / "export-best") or {}
                dist.print(f"held-out τ (depth {heldout.depth}): last step {step} {heldout.latest.heldout_tau:.3f}; best step {best.get('step')} {best.get('heldout_tau', float('nan')):.3f} in {run_dir / 'export-best'}")
        dist.barrier()
    if wandb_run is not None:
        wandb_run.finish()
    if lock is not None:
        lock.release()
    dist.end()
    return last
