"""The fine-tuning loop: feature store -> TTT unroll -> checkpoints, export and metrics.

`run_training(cfg, run_dir)` is what `train/finetune.py` calls under `accelerate launch`; every rank runs it:
setup (data, drafter, optimizer, resume, logs) -> fit (the steps) -> export, over one `Run` that holds the state
(train/run_state.py).
Reads `run_dir/features` and `run_dir/vocab.safetensors` (or the warm-start drafter's own vocab); with
`train.features: online`, `run_dir/tokens` and the target's own prefill instead (batches: train/data.py);
writes `run_dir/ckpt/step-N/`, `run_dir/export/` (the last step), `run_dir/export-best/` (the best step by held-out τ,
train/validate.py; each export's card.json says which step it is) and `run_dir/train/metrics.jsonl`.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from eagle3ft.config import Config, resolve_path
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.export import atomic_dir
from eagle3ft.drafter.folder import DFLASH_KIND, EAGLE3, drafter_spec, spec_family, write_folder
from eagle3ft.files import NonFinite, json_text, write_atomic, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.train.build import adopt_drafter_vocab, build_drafter, target_head
from eagle3ft.train.checkpoint import save_checkpoint, truncate_metrics
from eagle3ft.train.data import TrainData
from eagle3ft.train.dflash_objective import check_dflash_run, dflash_objective
from eagle3ft.train.l2sp import L2SP, SelfSetLambda, write_record
from eagle3ft.train.metrics import Meter, PhaseClock, SetupTimes, diverged, log_record, metrics_record, open_wandb
from eagle3ft.train.run_state import Run, data_identity, lr_lambda, resume
from eagle3ft.train.ttt import TTTObjective
from eagle3ft.train.validate import HeldoutTracker, read_card, write_card


class NonFiniteLoss(RuntimeError):
    """The loss (or the weights) became NaN or inf; names the step, the samples of the batch and the last good
    checkpoint to resume from."""


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


def seed_all(seed: int) -> None:
    """Seed every RNG the run uses (torch CPU and CUDA, Python's, NumPy's): one seed gives one run."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


# --------------------------------------------------------------------------- setup -> fit -> export


def run_training(cfg: Config, run_dir: str | Path, on_start: Callable[[dict | None], None] | None = None) -> dict:
    """Fine-tune the drafter on run_dir's features (or the target's, online: train/data.py).

    `on_start(resumed)` runs on the main process once every check has passed, before the run writes anything
    (train/finetune.py: --overwrite's removal, the config.yaml record); `resumed` says where a resume started.
    Returns the last metrics record."""
    run = setup(cfg, Path(run_dir), on_start)
    try:
        fit(run)
        export(run)
    except NonFinite as e:  # a checkpoint, export or best export of weights no longer finite: none is written
        raise NonFiniteLoss(
            f"non-finite weights after step {run.step} ({e}), not written; {run.resume_hint()}"
        ) from None
    if run.wandb_run is not None:
        run.wandb_run.finish()
    if run.lock is not None:
        run.lock.release()
    dist, last = run.dist, run.last
    del run  # the engine and optimizer go in dist.end, before the process group (see there)
    dist.end()
    return last


def setup(cfg: Config, run_dir: Path, on_start: Callable[[dict | None], None] | None = None) -> Run:
    """Data, drafter, processes, optimizer; the resumed position; the logs. Every check runs before any compute, and
    before anything is written (a refused start leaves the folder as it was)."""
    from eagle3ft.train.dist import Dist

    started = time.perf_counter()
    took = SetupTimes(started)
    tcfg = cfg.train
    # 1. data and drafter (checked against the features' identity)
    spec = drafter_spec(cfg.drafter, resolve_path)  # the kind, by drafter.config's architectures
    if isinstance(spec, DFlashConfig):
        check_dflash_run(cfg.train)
    data = TrainData(cfg, run_dir)
    took.mark("data")
    seed_all(cfg.seed)
    if isinstance(spec, DFlashConfig):
        objective = dflash_objective(cfg, run_dir, data, spec)
        model = objective.drafter
    else:
        model = build_drafter(cfg.drafter, cfg.target, run_dir, data.target, data.token_counts)
        if torch.cuda.is_available() if tcfg.engine.compile is None else tcfg.engine.compile:  # null: on with CUDA
            model.compile_blocks()
        objective = TTTObjective(
            model,
            tcfg.objective.ttt_steps,
            tcfg.objective.step_decay,
            target_head(cfg.train.objective, cfg.target, data, model),
            tcfg.objective.loss,
            tcfg.objective.lk_eta,
        )
    took.mark("drafter")

    # 2. processes and the run lock
    dist = Dist(tcfg)
    lock = dist.lock_run(run_dir)
    took.mark("processes")

    # 3. optimizer and LR schedule over the run's optimizer steps
    total = tcfg.schedule.max_steps or sum(
        math.ceil(math.ceil(data.micro_batches(e) / dist.world) / tcfg.batch.grad_accum)
        for e in range(tcfg.schedule.epochs)
    )
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # fused on CUDA: one kernel over DeepSpeed's flat fp32 partition
        trainable,
        lr=tcfg.optimizer.lr,
        weight_decay=tcfg.optimizer.weight_decay,
        betas=(0.9, 0.95),
        fused=dist.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg, total))
    engine, optimizer, scheduler = dist.prepare(objective, optimizer, scheduler)
    took.mark("engine")
    run = Run(cfg, run_dir, dist, data, model, engine, optimizer, scheduler, total, lock, started=started)
    run.identity = data_identity(data, getattr(model, "d2t", None))
    run.kind = spec_family(spec)
    lam = tcfg.objective.l2sp
    if lam == "auto" and cfg.drafter.init:  # set by the run itself after its first steps (train/l2sp.py)
        run.self_set = SelfSetLambda(total, tcfg.schedule.warmup_steps, lambda s: tcfg.optimizer.lr * run.lr_at(s))
    if run.self_set is not None or (lam != "auto" and lam > 0):  # w0: the masters before any step or resume
        inner, partitions = dist.master_partitions()
        run.l2sp = L2SP(0.0 if run.self_set is not None else lam, partitions)
        run.l2sp.attach(inner)
        run.w0_fingerprint = float(dist.reduce_sum(run.l2sp.local_w0_sq().to(dist.device)))

    # 4. resume: weights, optimizer, RNG, data position
    resumed = resume(run)
    took.mark("resume")

    # 5. every check has passed: the run starts writing; a warm start's vocab becomes the run's; held-out τ
    if dist.is_main:
        if on_start is not None:
            on_start(resumed)
        if cfg.drafter.init and run.kind == EAGLE3:
            note = adopt_drafter_vocab(run_dir, model.d2t, model.t2d, resolve_path(cfg.drafter.init))
            if note:
                dist.print(note)
    depth = model.config.block_size - 1 if run.kind == DFLASH_KIND else None  # a block's chain: its B - 1 drafts
    run.heldout = HeldoutTracker(
        run_dir,
        data.heldout(dist.device),
        cfg.train,
        cfg.eval,
        dist,
        resumed is not None,
        depth,
        data.validation,
        run.step,
    )
    took.mark("held-out set")

    # 6. logs: metrics.jsonl (cut back to the resumed step), the summary line, wandb
    if dist.is_main:
        open_logs(run, sum(p.numel() for p in trainable))
    dist.print(f"start-up: {took}")
    return run


def open_logs(run: Run, n_train: int) -> None:
    """Main process: the metrics file cut back to the current step, the run's summary line, the wandb run."""
    cfg, tcfg, dist, log_dir = run.cfg, run.cfg.train, run.dist, run.metrics_file.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    if dropped := truncate_metrics(run.metrics_file, run.step):
        dist.print(f"{run.metrics_file}: dropped {dropped} record(s) past step {run.step}")
    start = f"warm start from {resolve_path(cfg.drafter.init)}" if cfg.drafter.init else "from scratch"
    data = run.data
    subset = f" (a seeded subset of {data.all_answer_tokens:,})" if data.answer_tokens != data.all_answer_tokens else ""
    loops = ""
    if data.loop_tokens is not None:
        share = data.loop_tokens / max(data.answer_tokens, 1)
        loops = f", {data.loop_tokens:,} of them ({share:.1%}) in loops weighted {tcfg.objective.loop_weight:g}"
    dist.print(
        f"drafter: {n_train / 1e6:.1f}M trainable parameters, {start}; {len(data)} training samples, "
        f"{data.answer_tokens:,} answer tokens{subset}{loops} "
        f"({tcfg.data.features}{f', packed in {tcfg.batch.pack_tokens}-token rows' if tcfg.batch.pack_tokens else ''}); "
        f"{run.total} optimizer steps" + l2sp_note(run)
    )
    if data.weights is not None:
        dist.print(
            "sources, weight and share of the answer tokens an epoch draws: "
            + "; ".join(f"{n} x{m['weight']:g} {m['share']:.1%}" for n, m in data.mix.items())
        )
    what = json_text(  # what the run trains on: benchmarks/tau_curve.py reads the answer tokens from here
        {
            "where": data.where,
            "samples": len(data),
            "answer_tokens": data.answer_tokens,
            "all_answer_tokens": data.all_answer_tokens,
            "max_answer_tokens": tcfg.data.max_answer_tokens,
            "loop_weight": tcfg.objective.loop_weight,
            "loop_tokens": data.loop_tokens,  # answer tokens in loops, weighted loop_weight; null at loop_weight 1
            "epochs": tcfg.schedule.epochs,
            "optimizer_steps": run.total,
            "sources": data.mix,  # per source: samples, answer tokens, weight, share of the answer tokens drawn
        },
        str(log_dir / "data.json"),
        indent=1,
    )
    write_atomic(log_dir / "data.json", what.encode())
    run.wandb_run = open_wandb(cfg, log_dir)


def l2sp_note(run: Run) -> str:
    if run.l2sp is None:
        return ""
    if run.self_set is None or run.self_set.record is not None:
        return f"; L2-SP toward the starting weights, λ {run.l2sp.lam:g}"
    return f"; L2-SP toward the starting weights, λ set by the run after step {run.self_set.window} (train.l2sp auto)"


def settle_lambda(run: Run) -> None:
    """train.l2sp auto, at the calibration window's end: λ from the run's own first steps, said and recorded."""
    dist = run.dist
    rec = run.self_set.settle(run.engine, run.l2sp, dist.reduce_sum, dist.device, run.step)
    if dist.is_main:
        write_record(run.metrics_file.parent / "l2sp.json", rec)
    dist.print(f"train.l2sp auto: λ {rec['lambda']:.4g} from steps 1-{run.step} ({rec['why']})")


def fit(run: Run) -> None:
    """Optimizer steps until train.max_steps (or the epochs) or train.stop_after: log, held-out τ, checkpoints."""
    tcfg, dist, data, engine = run.cfg.train, run.dist, run.data, run.engine
    if run.heldout.guard is not None and run.heldout.guard.needs_start:  # the guard's reference and first candidate
        start = run.heldout.run(engine, run.model.config, run.step)
        dist.print(f"guard: the start's general τ {start['guard_sets']['general']:.4f}")
    dflash = run.kind == DFLASH_KIND
    meter = Meter(run.model.config.block_size - 1 if dflash else tcfg.objective.ttt_steps, dist.device, dflash)
    clock = PhaseClock(dist.device)
    step_samples = []
    bar = tqdm(
        total=run.total, initial=run.step, desc="train", unit="step", disable=not dist.is_main, dynamic_ncols=True
    )  # ETA from the step rate
    stop = run.step >= run.total
    while not stop:
        for micro_batch in data.epoch(dist, run.epoch, skip=run.batch_in_epoch):
            clock.mark("between")
            batch, sample_ids = micro_batch.tensors, micro_batch.sample_ids
            if dflash:  # the anchors' draw: this micro-batch's place in the run, the same after a resume
                batch = {**batch, "draw": torch.tensor([run.epoch, run.batch_in_epoch, dist.rank])}
            step_samples += sample_ids
            with oom_hint(), dist.accumulate(engine):
                out = engine(batch)
                clock.mark("forward")
                if run.self_set is not None:
                    run.self_set.take(run.step, batch, out.loss)
                if dist.any(not bool(torch.isfinite(out.loss))):
                    bad = dist.gather_ints(sample_ids if not torch.isfinite(out.loss) else [])
                    raise NonFiniteLoss(
                        f"non-finite loss at step {run.step + 1} (epoch {run.epoch}, micro-batch "
                        f"{run.batch_in_epoch}); sample ids per rank: {bad}; {run.resume_hint()}"
                    )
                lr = run.scheduler.get_last_lr()[0]  # the rate this step applies
                dist.backward(out.loss, between=lambda: clock.mark("backward"))
                run.optimizer.step()
                run.scheduler.step()
                run.optimizer.zero_grad()
            clock.mark("optimizer")
            meter.add(out, micro_batch.tokens)
            run.batch_in_epoch += 1
            if not dist.sync_gradients:
                continue
            if run.l2sp is not None:
                run.l2sp.end_step()
            run.step += 1
            clock.step()
            if run.self_set is not None and run.self_set.due(run.step):
                settle_lambda(run)
                clock.pause()
            if run.step == run.start_step + 1:  # the first step carries the warm-up: torch.compile's when on
                warm_up = " (torch.compile included)" if getattr(run.model, "blocks_compiled", False) else ""
                dist.print(f"first step: {time.perf_counter() - meter.t0:.1f} s{warm_up}")
            samples = dist.gather_ints(step_samples)  # every rank's samples of this optimizer step
            step_samples = []
            eval_now = run.heldout.due(run.step, run.total)
            if run.step % tcfg.logging.log_every == 0 or run.step == run.total or eval_now:
                run.last = metrics_record(meter, dist, tcfg, run.step, run.epoch, lr, samples, run.started)
                warn_if_diverging(run)
                run.last["phase_s"] = clock.take()  # this rank's seconds per step in each phase
                if run.l2sp is not None:  # Σ‖w − w0‖² before this step's update, and the penalty λ times it
                    run.last["l2sp_sq"] = float(dist.reduce_sum(run.l2sp.sq.to(dist.device)))
                    run.last["l2sp"] = run.l2sp.lam * run.last["l2sp_sq"]
                    run.last["l2sp_lambda"] = run.l2sp.lam
                    if run.self_set is not None and (run.self_set.record or {}).get("step") == run.step:
                        run.last["l2sp_self_set"] = run.self_set.record  # the step λ was set: its value and why
                if data.online is not None:  # this rank's share of the step that the target's prefill takes
                    run.last["online_prefill_s"] = data.online.take_seconds()
                    run.last["online_share"] = run.last["online_prefill_s"] / (
                        run.last["s_per_step"] * tcfg.logging.log_every
                    )
                if eval_now:
                    t_eval = time.perf_counter()
                    run.last.update(run.heldout.run(engine, run.model.config, run.step))
                    run.last["heldout_s"] = time.perf_counter() - t_eval
                    clock.pause()
                    if data.online is not None:
                        data.online.take_seconds()  # the held-out set's prefills are no training step's
                if dist.is_main:
                    log_record(run.last, run.metrics_file, run.wandb_run, bar)
                meter.reset()
            bar.update(1)
            done = run.step >= run.total or (
                tcfg.schedule.stop_after is not None and run.step - run.start_step >= tcfg.schedule.stop_after
            )
            if run.step % tcfg.checkpoint.save_every == 0 or done:
                save_checkpoint(
                    dist,
                    engine,
                    run.model.config,
                    run.run_dir,
                    run.step,
                    run.trainer_state(),
                    tcfg.checkpoint.keep_checkpoints,
                )
                clock.pause()
            if done:
                stop = True
                break
        else:
            run.epoch, run.batch_in_epoch = run.epoch + 1, 0
    bar.close()


def warn_if_diverging(run: Run) -> None:
    """Once per run: a console warning when the logged loss has risen DIVERGED times above the first logged loss
    (eval/report/build.py says it again from train/metrics.jsonl)."""
    loss = run.last["loss"]
    if run.first_loss is None:
        run.first_loss = loss
    elif not run.warned and diverged(loss, run.first_loss):
        run.warned = True
        run.dist.print(
            f"warning: the loss {loss:.4g} at step {run.step} is {loss / run.first_loss:.0f}x the first logged "
            f"loss {run.first_loss:.4g}: the training is diverging; {run.resume_hint()}"
        )


def export(run: Run) -> None:
    """run_dir/export: the last step's drafter in SGLang's form, when the run reached its end (once); with the guard,
    the step it chose (RUN/export-best, written when it was chosen)."""
    out, dist, heldout, step = RunDir(run.run_dir), run.dist, run.heldout, run.step
    if not (step >= run.total and (step > run.start_step or not out.export.exists())):
        return
    if heldout.guard is not None:
        export_guarded(run)
        return
    state = dist.full_state_dict(run.engine)
    if dist.is_main:
        with atomic_dir(out.export) as tmp:
            write_folder(tmp, run.model.config, state, prefix="drafter.")
            write_card(tmp, "last", step, heldout.latest, heldout.depth, heldout.latest_sets, heldout.block)
        dist.print(f"exported the drafter to {out.export} (SGLang: --speculative-draft-model-path {out.export})")
        if heldout.latest is not None:
            best = read_card(out.export_best) or {}
            sets = heldout.latest_sets["heldout_sets"]
            taus = ", ".join(f"{name} {v['tau']:.3f}" for name, v in sets.items())
            per_set = f" ({taus})" if len(sets) > 1 else ""
            on = f", chosen on {heldout.best_on}" if heldout.best_on else ""
            dist.print(
                f"held-out τ (depth {heldout.depth}): last step {step} {heldout.latest.heldout_tau:.3f}{per_set}; "
                f"best step {best.get('step')} {best.get('heldout_tau', float('nan')):.3f}{on} in {out.export_best}"
            )
    dist.barrier()


def export_guarded(run: Run) -> None:
    """RUN/export: the guard's choice (train/guard.py), copied from RUN/export-best; its card says which step, why,
    and the bound."""
    import shutil

    out, dist, choice = RunDir(run.run_dir), run.dist, run.heldout.choice
    if dist.is_main:
        card = read_card(out.export_best) or {}
        if card.get("step") != choice["step"]:
            raise RuntimeError(f"{out.export_best} holds step {card.get('step')}, the guard chose {choice['step']}")
        with atomic_dir(out.export) as tmp:
            for f in out.export_best.iterdir():
                shutil.copy2(f, tmp / f.name)
            write_json(tmp / "card.json", {**card, "which": "guarded", "guard": choice}, indent=2, newline=True)
        what = "the start (drafter.init)" if choice["kept_start"] else f"step {choice['step']}"
        dist.print(f"guard: exported {what} to {out.export}: {choice['why']}")
    dist.barrier()
