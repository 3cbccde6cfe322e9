"""train_speed.py's `theirs` sides: SpecForge 0.2.0's EAGLE-3 train step (TrainerCore.train_step), offline mode."""

from __future__ import annotations

import tempfile


def build_theirs(torch, a, opts, device, dtype, shared, weights_holder):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    backends = {"flex_attention", "sdpa"}
    unknown = set(opts) - backends - {"compact"}
    if unknown:
        raise SystemExit(f"unknown theirs option(s) {sorted(unknown)}")
    backend = next((o for o in opts if o in backends), "flex_attention")
    if backend == "flex_attention" and device.type == "cpu":
        raise SystemExit("SpecForge's flex_attention backend has no CPU backward; use theirs:sdpa on the CPU")
    compact = "compact" in opts
    torch_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    cfg = LlamaConfig(
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=max(4096, a.seq + a.ttt),
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        torch_dtype=torch_dtype,
    )
    cfg.draft_vocab_size = a.draft_vocab
    cfg.target_hidden_size = a.target_hidden
    with torch.device(device):
        draft = LlamaForCausalLMEagle3(cfg, attention_backend=backend)
    draft.to(dtype)
    missing, unexpected = draft.load_state_dict(weights_holder["sd"], strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise SystemExit(f"weight copy into SpecForge's drafter: missing {missing}, unexpected {unexpected}")
    draft.t2d.copy_(shared["t2d"])
    draft.d2t.copy_(shared["d2t"])
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=a.ttt, attention_backend=backend).to(device=device, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="sf-target-") as tmp, torch.device(device):
        LlamaConfig(hidden_size=a.target_hidden, vocab_size=a.vocab).save_pretrained(
            tmp
        )  # TargetHead reads hidden, vocab
        target_head = TargetHead(tmp)
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=dtype)
    with torch.no_grad():
        target_head.fc.weight.copy_(shared["W"])  # its own copy of the target lm_head, as SpecForge loads it
    backend_obj = FSDPTrainingBackend(
        ParallelConfig(param_dtype=dtype),
        optimizer_factory=lambda m: BF16Optimizer(m, lr=a.lr, max_grad_norm=a.max_grad_norm, total_steps=10_000),
    )
    wrapped = backend_obj.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = Eagle3TrainStrategy(wrapped, target_head=target_head, compact_teacher=compact)
    core = TrainerCore(strategy, backend_obj)
    b = shared["batch"]
    batch = TrainBatch(
        sample_ids=[str(i) for i in range(a.batch)],
        strategy="eagle3",
        tensors={
            "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"],
            "loss_mask": b["loss_mask"],
            "hidden_state": b["aux_hidden"],
            "target": b["last_hidden"],
        },
        metadata={"target_repr": "hidden_state"},
    )
    model.train()

    def step():
        return core.train_step(batch).loss  # forward, loss, backward, BF16Optimizer step, metrics (float)

    notes = (
        f"SpecForge TrainerCore.train_step, attention_backend={backend}, teacher="
        + ("compact (draft rows + streamed full-vocab lse/argmax)" if compact else "full-vocab TargetHead logits")
        + ", BF16Optimizer (fp32 master AdamW)"
    )
    # full-vocab head each step; compact: the draft rows plus the full vocab streamed for lse/argmax
    extra = 2 * a.target_hidden * (a.vocab + (a.draft_vocab if compact else 0))
    return step, notes, extra
