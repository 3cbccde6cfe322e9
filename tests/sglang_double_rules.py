"""The launch rules and answers of each SGLang version that the protocol double (tests/sglang_double.py) plays, read
from each version's wheel: 0.5.23's aux-capture launch check (srt/arg_groups/validation_hook.py:697-754), the three
meta_info keys it removed (0.5.17 srt/managers/tokenizer_manager.py:2795-2810), and the sampled-verification
settings each reports in /server_info at their defaults (0.5.23 srt/arg_groups/fields/spec.py:109-124), and how a
DFLASH server resolves its launch (0.5.17 srt/arg_groups/speculative_hook.py _handle_dflash and
_resolve_dflash_draft_attention_backend)."""

from __future__ import annotations

import argparse

VERSIONS = ("0.5.17", "0.5.23")
AUX_CAPTURE_FROM = (0, 5, 23)
REMOVED_IN_0_5_23 = ("spec_accept_histogram", "spec_accepted_drafts", "spec_proposed_drafts")
SAMPLING = {  # sampled verification's settings at their defaults (srt/server_args.py, fields/spec.py)
    "0.5.17": {
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
        "speculative_use_rejection_sampling": False,
    },
    "0.5.23": {
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
        "speculative_use_rejection_sampling": False,
        "speculative_use_block_verification": False,
    },
}


def vt(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def aux_capture(ap: argparse.ArgumentParser, args) -> list[int] | None:
    """0.5.23's launch check of aux capture (srt/arg_groups/validation_hook.py:697-754): the layer ids it captures,
    or None when it is off. EAGLE3 names the convention and is then reset, so no draft loads."""
    if not args.enable_return_aux_hidden_states:
        if args.return_aux_hidden_state_layer_ids is not None:
            ap.error("--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states.")
        return None
    method = (args.speculative_algorithm or "").upper()
    if method not in ("EAGLE3", "DFLASH", "DSPARK"):
        ap.error(
            "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH or DSPARK to name the "
            f"capture convention, got {args.speculative_algorithm!r}."
        )
    if method != "EAGLE3":
        ap.error(f"the double captures with the EAGLE3 convention, not {method}")
    if args.speculative_draft_model_path is not None:
        ap.error("--enable-return-aux-hidden-states captures without a draft; drop --speculative-draft-model-path.")
    ids = args.return_aux_hidden_state_layer_ids
    if ids is not None and (any(i < 0 for i in ids) or len(set(ids)) != len(ids)):
        ap.error(f"--return-aux-hidden-state-layer-ids must be non-negative and not repeat a layer, got {ids}.")
    if ids is None:  # the real server takes the model's own EAGLE3 layers; the double does not mirror that
        ap.error("the double captures the layers named by --return-aux-hidden-state-layer-ids only")
    args.speculative_algorithm = None
    return list(ids)


DFLASH_DRAFT_BACKENDS = ("flashinfer", "fa3", "fa4", "triton", "trtllm_mha", "ascend")


def dflash_server_args(args, block_size: int) -> dict:
    """What a DFLASH server reports in /server_info after its launch hook (0.5.17 speculative_hook.py:147-267): steps
    and topk forced to 1, num_draft_tokens = the block (--speculative-dflash-block-size, which must agree with
    --speculative-num-draft-tokens, else the drafter config's block_size), the draft attention backend resolved (the
    named one, else the target's, else flashinfer on CUDA; trtllm_mha only for all-sliding or causal drafts, which the
    double's bidirectional drafters are not), max_running_requests 48 unless given."""
    given, alias = args.speculative_num_draft_tokens, args.speculative_dflash_block_size
    if alias is not None and given is not None and given != alias:
        raise ValueError(
            "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but they differ. For "
            f"DFLASH they must match. speculative_num_draft_tokens={given}, speculative_dflash_block_size={alias}."
        )
    draft = args.speculative_draft_attention_backend or args.attention_backend
    if draft not in DFLASH_DRAFT_BACKENDS or draft == "trtllm_mha":
        draft = "flashinfer"
    return {
        "speculative_algorithm": "DFLASH",
        "speculative_num_steps": 1,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": alias or given or block_size,
        "speculative_dflash_block_size": alias,
        "speculative_draft_attention_backend": draft,
        "attention_backend": args.attention_backend,
        "max_running_requests": 48 if args.max_running_requests is None else args.max_running_requests,
        "speculative_accept_threshold_single": args.speculative_accept_threshold_single,
        "speculative_accept_threshold_acc": args.speculative_accept_threshold_acc,
    }
