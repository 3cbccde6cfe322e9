"""train_speed.py's `ours` sides: eagle3ft's TTT step (train/ttt.py's ttt_forward) with the optimizer arithmetic of
DeepSpeed ZeRO-2 bf16 on one GPU, and its experiment variants."""

from __future__ import annotations

import os

ADAM_BETAS = (0.9, 0.95)  # train/loop.py's AdamW


class MasterAdamW:
    """bf16 params/grads, fp32 master copies and fp32 AdamW state, grad-norm clip: the arithmetic of
    train/loop.py's torch AdamW under DeepSpeed ZeRO-2 bf16. With fp32 params the masters are the params."""

    def __init__(self, torch, params, lr, max_grad_norm, fused):
        self.torch, self.params, self.max_grad_norm = torch, list(params), max_grad_norm
        self.same = all(p.dtype == torch.float32 for p in self.params)
        self.masters = self.params if self.same else [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(
            self.masters, lr=lr, betas=ADAM_BETAS, weight_decay=0.0, **({"fused": True} if fused else {"foreach": True})
        )

    def step(self):
        torch = self.torch
        if not self.same:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
                p.grad = None
        gn = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if not self.same:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return gn


class BF16AdamW:
    def __init__(self, torch, params, lr, max_grad_norm, fused):
        self.torch, self.params, self.max_grad_norm = torch, list(params), max_grad_norm
        self.opt = torch.optim.AdamW(
            self.params, lr=lr, betas=ADAM_BETAS, weight_decay=0.0, **({"fused": True} if fused else {"foreach": True})
        )

    def step(self):
        gn = self.torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return gn


def build_ours(torch, a, opts, device, dtype, shared, weights_holder):
    from eagle3ft.config import resolve_path
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model_mla import new_drafter

    known = {"topk", "hidden", "compile", "tf32", "baseline"}
    kv = dict(o.split("=", 1) for o in opts if "=" in o)
    flags = {o for o in opts if "=" not in o}
    if flags - known or set(kv) - {"adam", "lse_chunk", "head_chunk", "attn", "merge", "wgrad"}:
        raise SystemExit(f"unknown ours option(s) in {opts}")
    if "baseline" in flags:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "ttt_baseline", os.path.join(os.path.dirname(os.path.abspath(__file__)), "ttt_baseline.py")
        )
        ttt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ttt)
        modules = [ttt]
    else:
        from eagle3ft.drafter import wgrad
        from eagle3ft.train import attention, losses, ttt

        modules = [ttt, attention, losses, wgrad]
    form = "hidden" if "hidden" in flags else "topk"
    cfg = DrafterConfig(
        hidden_size=a.hidden,
        target_hidden_size=a.target_hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        draft_vocab_size=a.draft_vocab,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=max(4096, a.seq + a.ttt),
    )
    if a.drafter:  # its layout (Eagle3DeepseekV2ForCausalLM: MLA) and dims; parse_args set a's dims from it
        cfg = DrafterConfig.from_json(resolve_path(a.drafter), draft_vocab_size=a.draft_vocab)
    with torch.device(device):
        model = new_drafter(cfg)
    # train/loop.py builds the drafter on the CPU and the engine moves parameters and buffers only, so plain
    # tensor attributes (rope's inv_freq) stay on the CPU there: place them the same way here
    for name, val in list(vars(model).items()):
        if isinstance(val, torch.Tensor):
            setattr(model, name, val.cpu())
    model.to(dtype)
    if weights_holder.get("sd") is None:
        # the weights every side starts from, kept on the host so no side's memory counts them
        weights_holder["sd"] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    else:
        model.load_state_dict(weights_holder["sd"])
    model.d2t.copy_(shared["d2t"])
    model.t2d.copy_(shared["t2d"])
    model.embed_tokens.weight.requires_grad_(False)
    model.train()
    if "compile" in flags:
        model.compile_blocks()  # train.compile: the norms, q/k/v + rope, the MLP; the unroll stays eager
    # experiment knobs: module constants of train/ttt.py and the modules it calls, set around this side's steps only
    knobs = {}
    if "lse_chunk" in kv:
        knobs["LSE_CHUNK"] = int(kv["lse_chunk"])
    if "head_chunk" in kv:
        knobs["HEAD_CHUNK"] = int(kv["head_chunk"])
    if "attn" in kv:
        knobs["ATTENTION"] = kv["attn"]
    if kv.get("merge", "compiled") not in ("compiled", "eager"):
        raise SystemExit(f"merge={kv['merge']}: expected compiled or eager")
    if kv.get("wgrad", "deferred") not in ("deferred", "autograd"):
        raise SystemExit(f"wgrad={kv['wgrad']}: expected deferred or autograd")
    if "merge" in kv:
        knobs["MERGE_COMPILE"] = kv["merge"] == "compiled"
    if "wgrad" in kv:
        knobs["DEFER"] = kv["wgrad"] == "deferred"
    owners = {name: next((m for m in modules if hasattr(m, name)), None) for name in knobs}
    for name, owner in owners.items():
        if owner is None:
            raise SystemExit(f"train/ttt.py and its modules have no {name} any more; drop that variant option")
    heads = next(m for m in modules if hasattr(m, "head_cross_entropy"))  # the module of the fused head CE
    # head_cross_entropy reads HEAD_CHUNK at call time when its `chunk` default is None; if a version binds the
    # constant as the default instead, that default is what must change
    import inspect

    chunk_param = inspect.signature(heads.head_cross_entropy).parameters.get("chunk")
    bind_default = (
        "HEAD_CHUNK" in knobs
        and chunk_param is not None
        and chunk_param.default is not None
        and list(inspect.signature(heads.head_cross_entropy).parameters)[-1] == "chunk"
    )
    params = [p for p in model.parameters() if p.requires_grad]
    adam = kv.get("adam", "master")
    adams = {"master": (MasterAdamW, False), "fused": (MasterAdamW, True), "bf16": (BF16AdamW, device.type == "cuda")}
    if adam not in adams:
        raise SystemExit(f"adam={adam}: expected one of {sorted(adams)}")
    cls, fused = adams[adam]
    opt = cls(torch, params, a.lr, a.max_grad_norm, fused)
    batch = dict(shared["batch"])
    head = shared["W"][shared["t2d"]].clone() if form == "hidden" else None  # (Vd, Ht) draft rows, owned by this side
    tf32 = "tf32" in flags

    def step():
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        saved = {n: getattr(owners[n], n) for n in knobs}
        saved_defaults = heads.head_cross_entropy.__defaults__
        torch.backends.cuda.matmul.allow_tf32 = tf32 or prev_tf32
        for n, v in knobs.items():
            setattr(owners[n], n, v)
        if bind_default:
            heads.head_cross_entropy.__defaults__ = saved_defaults[:-1] + (knobs["HEAD_CHUNK"],)
        try:
            out = ttt.ttt_forward(model, batch, steps=a.ttt, decay=a.decay, target_head=head)
            out.loss.backward()
            opt.step()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
            for n, v in saved.items():
                setattr(owners[n], n, v)
            heads.head_cross_entropy.__defaults__ = saved_defaults
        return out.loss.detach()

    notes = (
        ("benchmarks/train_speed/ttt_baseline.py" if "baseline" in flags else "eagle3ft")
        + f" ttt_forward, teacher={form}"
        + (f" (top-{a.topk})" if form == "topk" else " (target head rows of the draft vocab)")
        + {
            "master": ", AdamW(foreach) on fp32 masters",
            "fused": ", fused AdamW on fp32 masters",
            "bf16": ", fused AdamW on the bf16 params",
        }[adam]
        + (", compile_blocks" if "compile" in flags else "")
        + (", tf32" if tf32 else "")
        + "".join(f", {n}={v}" for n, v in knobs.items())
    )
    extra = 2 * a.target_hidden * a.draft_vocab if form == "hidden" else 0
    return step, notes, extra
