"""L2-SP toward the starting weights (train.l2sp): the penalty's gradient against autograd's, the trainer under
ZeRO-2 and ZeRO-3 against a plain-torch reference of the penalised loss, and a bit-identical resume."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_train_resume import assert_same_state
from train_fixtures import REPO, launch, write_store

from eagle3ft.config import load_config
from eagle3ft.data.store import collate
from eagle3ft.drafter.export import drafter_tensors
from eagle3ft.train.build import build_drafter
from eagle3ft.train.checkpoint import CheckpointError
from eagle3ft.train.data import TrainData
from eagle3ft.train.l2sp import L2SP
from eagle3ft.train.loop import seed_all
from eagle3ft.train.run_state import check_w0, lr_lambda
from eagle3ft.train.ttt import TTTObjective

TINY = REPO / "configs/tiny.yaml"
LAM = 0.5
COMMON = (
    "train.schedule.warmup_steps=2",
    "train.optimizer.lr=3e-3",
    "train.checkpoint.save_every=2",
    "train.objective.ttt_steps=3",
    "train.schedule.max_steps=4",
)
Z3 = "train.engine.deepspeed=configs/deepspeed/zero3.json"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


def ok(r) -> None:
    assert r.returncode == 0, r.stderr[-4000:]


def test_the_hook_steps_as_autograd_on_the_penalised_loss():
    torch.manual_seed(0)
    w0 = [torch.randn(5, 3), torch.randn(7)]
    target = [torch.randn(5, 3), torch.randn(7)]

    def run(how: str) -> tuple[list[torch.Tensor], list[float]]:
        """5 AdamW steps on a data loss: with the hook, with λ‖w − w0‖² through autograd, or with no penalty."""
        ps = [torch.nn.Parameter(x.clone()) for x in w0]
        opt = torch.optim.AdamW(ps, lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
        l2sp = L2SP(0.3, ps)
        if how == "hook":
            l2sp.attach(opt)
        seen = []
        for _ in range(5):
            opt.zero_grad()
            sum(((p - t) ** 4).sum() for p, t in zip(ps, target)).backward()
            sq = sum(((p - w) ** 2).sum() for p, w in zip(ps, w0))
            if how == "autograd":
                (0.3 * sq).backward()
            opt.step()
            l2sp.end_step()
            seen.append(float(l2sp.sq) if how == "hook" else float(sq.detach()))
        return [p.detach() for p in ps], seen

    (hooked, sq_hook), (ref, sq_ref), (free, _) = run("hook"), run("autograd"), run("none")
    for x, y in zip(hooked, ref):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert sq_hook == pytest.approx(sq_ref, rel=1e-6) and sq_hook[0] == 0 and sq_hook[-1] > 0
    assert (free[0] - hooked[0]).abs().max() > 1e-2  # the penalty moved the weights


def test_a_stepped_tensor_without_w0_is_refused():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p, q], lr=0.1)
    L2SP(1.0, [p]).attach(opt)
    (p.sum() + q.sum()).backward()
    with pytest.raises(RuntimeError, match="the optimizer steps a tensor of 4 elements that is none of the master"):
        opt.step()


def test_a_resume_toward_other_starting_weights_is_refused(tmp_path):
    run = SimpleNamespace(l2sp=object(), w0_fingerprint=12.5)
    check_w0(run, {"l2sp": {"lambda": 0.1, "w0_sq": 12.5 * (1 + 1e-12)}}, tmp_path)  # rounding of other world sizes
    check_w0(run, {}, tmp_path)  # written without L2-SP: the start is what the build gives now
    with pytest.raises(CheckpointError, match=r"Σw0² 12.5\) are not the ones this checkpoint's run started from"):
        check_w0(run, {"l2sp": {"lambda": 0.1, "w0_sq": 13.0}}, tmp_path)


def reference(run: Path, lam: float, world: int = 2) -> tuple[dict[str, torch.Tensor], list[float]]:
    """What the trainer must compute, in plain torch on one process: each step averages the loss of the `world`
    ranks' micro-batches (rank r takes draws r, r + world, ... of the epoch order), clips it as DeepSpeed does,
    adds λ‖w − w0‖²'s gradient through autograd, and steps AdamW on the trainer's schedule. Returns the weights and
    Σ‖w − w0‖² before each step."""
    cfg = load_config(TINY, [*COMMON, f"train.l2sp={lam}"])
    tcfg = cfg.train
    data = TrainData(cfg, run)
    seed_all(cfg.seed)
    obj = TTTObjective(
        build_drafter(cfg.drafter, cfg.target, run, data.target, data.token_counts),
        tcfg.objective.ttt_steps,
        tcfg.objective.step_decay,
    )
    params = [p for p in obj.parameters() if p.requires_grad]
    w0 = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=tcfg.optimizer.lr, weight_decay=tcfg.optimizer.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tcfg, tcfg.schedule.max_steps))
    order, sq = data.order(0), []
    for step in range(tcfg.schedule.max_steps):
        opt.zero_grad()
        for r in range(world):
            batch = collate([data.dataset[order[world * step + r]]], max_len=tcfg.batch.max_len)
            batch.pop("sample_id")
            (obj(batch).loss / world).backward()
        torch.nn.utils.clip_grad_norm_(params, tcfg.optimizer.max_grad_norm)
        penalty = sum(((p - w) ** 2).sum() for p, w in zip(params, w0))
        sq.append(float(penalty.detach()))
        (lam * penalty).backward()
        opt.step()
        sched.step()
    return drafter_tensors(obj.state_dict(), prefix="drafter."), sq


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four L2-SP steps on 2 processes under ZeRO-2 and ZeRO-3 (checkpoints at steps 2 and 4)."""
    out = {}
    for name, extra in (("z2", ()), ("z3", (Z3,))):
        run = tmp_path_factory.mktemp(name)
        write_store(run)
        ok(launch(run, *COMMON, f"train.l2sp={LAM}", *extra))
        out[name] = run
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_the_trainer_steps_as_the_reference_of_the_penalised_loss(runs, stage):
    run = runs[stage]
    want, sq = reference(run, LAM)
    got = load_file(run / "export" / "model.safetensors")
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    rows = metrics(run)
    assert [r["l2sp_sq"] for r in rows] == pytest.approx(sq, rel=1e-4)  # Σ‖w − w0‖², summed over the ranks
    assert [r["l2sp"] for r in rows] == pytest.approx([LAM * x for x in sq], rel=1e-4) and sq[-1] > 0
    free, _ = reference(run, 0.0)  # the penalty moved the weights by far more than the tolerance
    assert max(float((free[k] - want[k]).abs().max()) for k in want if want[k].is_floating_point()) > 1e-3
    state = json.loads((run / "ckpt" / "step-4" / "trainer_state.json").read_text())
    assert state["l2sp"]["lambda"] == LAM and state["l2sp"]["w0_sq"] > 0


@pytest.mark.slow
def test_zero3_resume_is_bit_identical(runs, tmp_path):
    run = shutil.copytree(runs["z3"], tmp_path / "run")
    for later in ("export", "export-best", "ckpt/step-4"):  # the run as it stood at its step-2 checkpoint
        shutil.rmtree(run / later)
    r = launch(run, *COMMON, f"train.l2sp={LAM}", Z3, extra=("--resume", "auto"))
    ok(r)
    assert f"resumed from {run / 'ckpt' / 'step-2'} at step 2" in r.stdout + r.stderr
    resumed, straight = metrics(run), metrics(runs["z3"])
    assert [x["step"] for x in resumed] == [1, 2, 3, 4]
    keys = ("samples", "loss", "step_loss", "lr", "l2sp_sq", "l2sp")
    assert [[x[k] for k in keys] for x in resumed] == [[x[k] for k in keys] for x in straight]
    a, b = load_file(run / "export" / "model.safetensors"), load_file(runs["z3"] / "export" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert_same_state(run / "ckpt" / "step-4", runs["z3"] / "ckpt" / "step-4")
