"""The acceptance-targeted losses (tv, lk, lk_hybrid): fused chunked head against a naive fp64 autograd reference."""

import pytest
import torch

from eagle3ft.train.losses import LK_EPS, head_loss
from eagle3ft.train.ttt import TTTObjective, ttt_forward

N, HD, VD, K = 9, 6, 13, 4


def naive(kind: str, logits: torch.Tensor, p_dense: torch.Tensor, eta: float) -> torch.Tensor:
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(p_dense, q).sum(-1)
    if kind == "tv":
        return 1 - alpha
    if kind == "lk":
        return -alpha.clamp(min=LK_EPS).log()
    kl = (torch.xlogy(p_dense, p_dense) - p_dense * torch.log_softmax(logits, -1)).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


def sparse_target(g: torch.Generator):
    """Distinct draft ids per row plus one entry outside the draft vocab (id 0, p 0), as topk_to_draft gives them."""
    ids = torch.stack([torch.randperm(VD, generator=g)[: K - 1] for _ in range(N)])
    ids = torch.cat([ids, torch.zeros(N, 1, dtype=torch.long)], 1)
    p = torch.softmax(torch.randn(N, K - 1, generator=g, dtype=torch.float64) * 2, -1)
    p = torch.cat([p, torch.zeros(N, 1, dtype=torch.float64)], 1)
    return ids, p, torch.zeros(N, VD, dtype=torch.float64).scatter_add_(1, ids, p)


@pytest.mark.parametrize("kind", ["tv", "lk", "lk_hybrid"])
@pytest.mark.parametrize("sparse", [True, False])
def test_overlap_losses_match_autograd(kind, sparse):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, HD, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(VD, HD, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    if sparse:
        ids, p, dense = sparse_target(g)
    else:
        ids, p = None, torch.softmax(torch.randn(N, VD, generator=g, dtype=torch.float64) * 2, -1)
        dense = p
    up = torch.randn(N, generator=g, dtype=torch.float64)
    loss, pred = head_loss(x, w, ids, p, loss=kind, eta=2.0, chunk=4)  # chunks of 4 rows
    (loss * up).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    logits = x @ w.t()
    ref = naive(kind, logits, dense, 2.0)
    (ref * up).sum().backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)  # the value is kept in float32
    assert pred.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)  # through the float32 value: its rounding, ~1e-7
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)


def test_tv_is_one_minus_overlap_by_hand():
    """Two draft tokens, logits equal: q = (1/2, 1/2); p = (0.9, 0.1) -> alpha = 0.5 + 0.1 = 0.6."""
    x, w = torch.ones(1, 1), torch.ones(2, 1)
    p, ids = torch.tensor([[0.9, 0.1]]), torch.tensor([[0, 1]])
    assert head_loss(x, w, ids, p, loss="tv")[0].item() == pytest.approx(0.4)
    assert head_loss(x, w, ids, p, loss="lk")[0].item() == pytest.approx(-torch.tensor(0.6).log().item())
    with pytest.raises(ValueError, match="train.loss 'kl' is not one of ce, tv, lk, lk_hybrid"):
        head_loss(x, w, ids, p, loss="kl")


def test_lk_equals_ce_on_one_hot_targets():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, HD, generator=g), torch.randn(VD, HD, generator=g)
    ids, p = torch.randint(0, VD, (5, 1), generator=g), torch.ones(5, 1)
    torch.testing.assert_close(head_loss(x, w, ids, p, loss="lk")[0], head_loss(x, w, ids, p, loss="ce")[0])


def test_ttt_with_each_loss_trains_and_counts_the_same_way():
    """The unroll takes the loss by name; the counts (argmax matches) do not depend on it; a bad name is refused."""
    from test_train_ttt import batch, drafter

    m, b = drafter(seed=2), batch(seed=4)
    ref = ttt_forward(m, b, steps=3)
    for kind in ("tv", "lk", "lk_hybrid"):
        out = ttt_forward(m, b, steps=3, loss_kind=kind)
        assert torch.equal(out.correct, ref.correct) and torch.equal(out.chain_valid, ref.chain_valid)
        out.loss.backward()
        assert m.fc.weight.grad is not None and torch.isfinite(m.fc.weight.grad).all()
        m.zero_grad()
    with pytest.raises(ValueError, match="train.loss"):
        TTTObjective(m, 3, 0.8, loss="mse")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["ce", "tv", "lk", "lk_hybrid"])
def test_overlap_losses_in_bf16_on_cuda_are_close_to_fp64(kind):
    """The bf16 path training takes on the GPU (logits and d in bf16, softmax in fp32) against the fp64 reference."""
    g = torch.Generator().manual_seed(5)
    n, h, vd = 512, 64, 4096
    x64 = torch.randn(n, h, generator=g, dtype=torch.float64) / 4
    w64 = torch.randn(vd, h, generator=g, dtype=torch.float64) / 4
    ids = torch.stack([torch.randperm(vd, generator=g)[:16] for _ in range(n)])
    p = torch.softmax(torch.randn(n, 16, generator=g, dtype=torch.float64) * 2, -1)
    dense = torch.zeros(n, vd, dtype=torch.float64).scatter_add_(1, ids, p)
    x, w = x64.cuda().bfloat16().requires_grad_(), w64.cuda().bfloat16().requires_grad_()
    loss, _ = head_loss(x, w, ids.cuda(), p.cuda().float(), loss=kind, chunk=128)
    loss.sum().backward()
    xr, wr = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    logits = xr @ wr.t()
    ref = -(dense * torch.log_softmax(logits, -1)).sum(-1) if kind == "ce" else naive(kind, logits, dense, 3.0)
    ref.sum().backward()
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=2e-2, atol=2e-3)
    for ours, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        rel = (ours.double().cpu() - want).norm() / want.norm()
        assert rel < 2e-2, f"{kind}: relative gradient error {rel:.3g}"
