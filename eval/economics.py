"""Speculation economics: when does a drafter pay for itself?

One speculative cycle drafts `steps` tokens (one drafter forward each; the first one is the
extend after the previous verify), verifies `num_draft_tokens` tokens with one target forward,
and emits tau tokens on average (bonus included, like SGLang's spec_accept_length):

    cycle_s(setting)   = steps * draft_forward_s + verify_s(num_draft_tokens) + overhead_s
    tok/s(tau)         = tau / cycle_s
    break-even tau     = cycle_s / baseline_s_per_token      (speculation == plain decoding)
    tau for R tok/s    = R * cycle_s

Worked example (tests/test_eval_economics.py): a 29 ms cycle at tau 2.0 gives 2.0/0.029 = 69 tok/s;
150 tok/s needs tau = 150 * 0.029 = 4.35; against a 82 tok/s baseline (12.195 ms/token) the
break-even tau is 0.029 * 82 = 2.38 (with 12.1 ms/token it is 29/12.1 = 2.40).

`python eval/economics.py --config CFG --run-dir RUN` reads RUN/bench/summary.json (and the offline
RUN/eval/accept_len.json when present), prints predicted against measured tok/s per setting and
writes RUN/bench/economics.json.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    """SGLang's speculation knobs: --speculative-num-steps / -eagle-topk / -num-draft-tokens."""

    steps: int
    topk: int
    num_draft_tokens: int

    @property
    def key(self) -> str:
        return f"{self.steps}/{self.topk}/{self.num_draft_tokens}"

    @classmethod
    def of(cls, obj) -> "Setting":
        if isinstance(obj, Setting):
            return obj
        if isinstance(obj, dict):
            return cls(int(obj["steps"]), int(obj["topk"]), int(obj["num_draft_tokens"]))
        return cls(int(obj.steps), int(obj.topk), int(obj.num_draft_tokens))


@dataclass
class CostModel:
    """Measured costs. verify_s maps a number of verified tokens to the seconds of one target forward."""

    baseline_s_per_token: float
    verify_s: dict[int, float]
    draft_forward_s: float = 0.0
    overhead_s: float = 0.0  # per cycle: sampling, acceptance bookkeeping, cache crops

    def verify_time(self, num_tokens: int) -> float:
        """Seconds for one verify of `num_tokens`; linear between measured sizes, flat beyond them."""
        if not self.verify_s:
            raise ValueError("no verify costs measured")
        sizes = sorted(self.verify_s)
        if num_tokens in self.verify_s:
            return self.verify_s[num_tokens]
        if num_tokens <= sizes[0]:
            return self.verify_s[sizes[0]]
        if num_tokens >= sizes[-1]:
            return self.verify_s[sizes[-1]]
        i = bisect.bisect_left(sizes, num_tokens)
        lo, hi = sizes[i - 1], sizes[i]
        w = (num_tokens - lo) / (hi - lo)
        return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]

    def cycle_s(self, setting: Setting) -> float:
        return setting.steps * self.draft_forward_s + self.verify_time(setting.num_draft_tokens) + self.overhead_s

    @property
    def baseline_tok_s(self) -> float:
        return 1.0 / self.baseline_s_per_token

    def tok_per_s(self, tau: float, setting: Setting) -> float:
        return tau / self.cycle_s(setting)

    def break_even_tau(self, setting: Setting) -> float:
        return self.cycle_s(setting) / self.baseline_s_per_token

    def tau_for(self, tok_s: float, setting: Setting) -> float:
        return tok_s * self.cycle_s(setting)

    def speedup(self, tau: float, setting: Setting) -> float:
        return self.tok_per_s(tau, setting) / self.baseline_tok_s


@dataclass
class SettingEconomics:
    setting: str
    cycle_ms: float
    break_even_tau: float
    max_tau: int  # steps + 1: every draft accepted plus the bonus
    tau_live: float | None = None
    tau_offline: float | None = None
    predicted_tok_s_live_tau: float | None = None
    predicted_tok_s_offline_tau: float | None = None
    measured_tok_s: float | None = None
    measured_cycle_ms: float | None = None


@dataclass
class Economics:
    baseline_tok_s: float
    baseline_ms_per_token: float
    verify_ms: dict[int, float]
    draft_forward_ms: float
    overhead_ms: float
    settings: list[SettingEconomics] = field(default_factory=list)
    best_setting: str | None = None
    best_basis: str | None = None  # which tau chose the best setting: live or offline
    # every setting with an offline tau (benchmarked or not), priced with the measured costs
    offline_predictions: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def cost_model_from_summary(summary: dict) -> CostModel:
    """The cost model measured by eval/bench.py (bench/summary.json's `costs`)."""
    c = summary["costs"]
    return CostModel(
        baseline_s_per_token=c["baseline_s_per_token"],
        verify_s={int(k): v for k, v in c["verify_s"].items()},
        draft_forward_s=c.get("draft_forward_s") or 0.0,
        overhead_s=c.get("overhead_s") or 0.0,
    )


def analyse(summary: dict, offline_tau: dict[str, float] | None = None) -> Economics:
    """Predicted against measured for every benchmarked setting, and the best of them.

    `offline_tau` maps a setting key ("steps/topk/draft_tokens") to the offline accept length.
    """
    cm = cost_model_from_summary(summary)
    offline_tau = offline_tau or {}
    rows = []
    for s in summary["speculative"]:
        st = Setting.of(s["setting"])
        tau_live = s.get("tau")
        tau_off = offline_tau.get(st.key)
        rows.append(
            SettingEconomics(
                setting=st.key,
                cycle_ms=1e3 * cm.cycle_s(st),
                break_even_tau=cm.break_even_tau(st),
                max_tau=st.steps + 1,
                tau_live=tau_live,
                tau_offline=tau_off,
                predicted_tok_s_live_tau=cm.tok_per_s(tau_live, st) if tau_live else None,
                predicted_tok_s_offline_tau=cm.tok_per_s(tau_off, st) if tau_off else None,
                measured_tok_s=s.get("tok_s_median"),
                measured_cycle_ms=1e3 * s["cycle_s"] if s.get("cycle_s") else None,
            )
        )
    best, basis = None, None
    for b in ("live", "offline"):
        scored = [(getattr(r, f"predicted_tok_s_{b}_tau"), r.setting) for r in rows if getattr(r, f"predicted_tok_s_{b}_tau")]
        if scored:
            best, basis = max(scored)[1], b
            break
    offline_rows = []
    for key, tau in sorted(offline_tau.items()):
        st = Setting(*map(int, key.split("/")))
        offline_rows.append(
            {"setting": key, "tau_offline": tau, "cycle_ms": 1e3 * cm.cycle_s(st), "break_even_tau": cm.break_even_tau(st), "predicted_tok_s": cm.tok_per_s(tau, st)}
        )
    return Economics(
        offline_predictions=offline_rows,
        baseline_tok_s=cm.baseline_tok_s,
        baseline_ms_per_token=1e3 * cm.baseline_s_per_token,
        verify_ms={k: 1e3 * v for k, v in sorted(cm.verify_s.items())},
        draft_forward_ms=1e3 * cm.draft_forward_s,
        overhead_ms=1e3 * cm.overhead_s,
        settings=rows,
        best_setting=best,
        best_basis=basis,
    )


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(ec: Economics) -> str:
    lines = [
        f"baseline {ec.baseline_tok_s:.1f} tok/s ({ec.baseline_ms_per_token:.2f} ms/token); "
        f"draft forward {ec.draft_forward_ms:.2f} ms; cycle overhead {ec.overhead_ms:.2f} ms",
        "verify ms by tokens: " + ", ".join(f"{k}: {v:.2f}" for k, v in ec.verify_ms.items()),
        f"{'setting':>9} {'cycle ms':>9} {'meas. cyc':>9} {'break-even':>10} {'tau live':>8} {'tau off':>8} "
        f"{'pred(live)':>10} {'pred(off)':>10} {'measured':>9}",
    ]
    for r in ec.settings:
        lines.append(
            f"{r.setting:>9} {r.cycle_ms:>9.2f} {_f(r.measured_cycle_ms):>9} {r.break_even_tau:>10.2f} {_f(r.tau_live):>8} "
            f"{_f(r.tau_offline):>8} {_f(r.predicted_tok_s_live_tau, '{:.1f}'):>10} "
            f"{_f(r.predicted_tok_s_offline_tau, '{:.1f}'):>10} {_f(r.measured_tok_s, '{:.1f}'):>9}"
        )
    if ec.best_setting:
        lines.append(f"best measured setting by predicted tok/s ({ec.best_basis} tau): {ec.best_setting}")
    if ec.offline_predictions:
        best = max(ec.offline_predictions, key=lambda r: r["predicted_tok_s"])
        lines.append(
            "offline tau priced with these costs: "
            + ", ".join(f"{r['setting']} {r['predicted_tok_s']:.1f}" for r in ec.offline_predictions)
            + f" tok/s (best {best['setting']})"
        )
    return "\n".join(lines)


def offline_tau_by_setting(accept_len_json: Path) -> dict[str, float]:
    if not accept_len_json.exists():
        return {}
    doc = json.loads(accept_len_json.read_text())
    return {k: v["tau"] for k, v in doc.get("settings", {}).items()}


def run(run_dir: Path) -> Economics:
    summary = json.loads((run_dir / "bench" / "summary.json").read_text())
    ec = analyse(summary, offline_tau_by_setting(run_dir / "eval" / "accept_len.json"))
    out = run_dir / "bench" / "economics.json"
    out.write_text(json.dumps(ec.to_dict(), indent=2))
    return ec


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.data.config import parse_cli

    _, run_dir, _ = parse_cli("Speculation economics from a benchmark run.", stage="economics", argv=argv)
    print(format_table(run(run_dir)))


if __name__ == "__main__":
    main()
