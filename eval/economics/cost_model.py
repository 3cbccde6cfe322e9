"""The cost model of speculation: when does a drafter pay for itself?

One speculative cycle drafts `steps` tokens (one drafter forward each; the first one is the
extend after the previous verify), verifies `num_draft_tokens` tokens with one target forward,
and emits tau tokens on average (bonus included, like SGLang's spec_accept_length):

    cycle_s(setting)   = steps * draft_forward_s + verify_s(num_draft_tokens) + overhead_s
    tok/s(tau)         = tau / cycle_s
    break-even tau     = cycle_s / baseline_s_per_token      (speculation == plain decoding)
    tau for R tok/s    = R * cycle_s

A DFlash block cycle (`CostModel(block=True)`, setting B-1/1/B) drafts its B - 1 tokens in one drafter forward:
    cycle_s(block B)   = draft_forward_s + verify_s(B) + overhead_s
so its cost is flat in B but for the verify; it emits at most B tokens (B - 1 drafts and the bonus).

Worked example (tests/test_eval_economics.py): a 29 ms cycle at tau 2.0 gives 2.0/0.029 = 69 tok/s;
150 tok/s needs tau = 150 * 0.029 = 4.35; against a 82 tok/s baseline (12.195 ms/token) the
break-even tau is 0.029 * 82 = 2.38 (with 12.1 ms/token it is 29/12.1 = 2.40).

A tau is out of reach at a setting when it exceeds the most a cycle can emit: steps + 1 (every draft
accepted plus the bonus; at most num_draft_tokens for a tree). "tau 4.35 for 150 tok/s" cannot happen
at 2/1/3, whose tau is at most 3; `reach` names the shallowest chain where the needed tau fits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from eagle3ft.setting import Setting


@dataclass
class CostModel:
    """Measured costs. verify_s maps a number of verified tokens to the seconds of one target forward."""

    baseline_s_per_token: float
    verify_s: dict[int, float]
    draft_forward_s: float = 0.0
    overhead_s: float = 0.0  # per cycle: sampling, acceptance bookkeeping, cache crops
    # a DFlash block drafter (block setting B-1/1/B): ONE drafter forward per cycle drafts the whole block, so a
    # cycle is draft_forward_s + verify_s(B) + overhead_s whatever B is; False: EAGLE-3's chain, one forward per step
    block: bool = False

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
        forwards = 1 if self.block else setting.steps
        return forwards * self.draft_forward_s + self.verify_time(setting.num_draft_tokens) + self.overhead_s

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


def max_tau(setting: Setting) -> int:
    """The most one cycle can emit: every draft accepted plus the bonus (a tree verifies num_draft_tokens - 1
    drafts)."""
    return min(setting.steps + 1, setting.num_draft_tokens)


CHAINS = [Setting(d, 1, d + 1) for d in range(1, 9)]
GOAL_SPEEDUPS = (1.0, 1.5, 2.0)  # speed-ups over plain decoding the report prices; 1.0 is break-even


def reach(cm: CostModel, tok_s: float, setting: Setting, candidates: list[Setting] = CHAINS) -> dict:
    """The tau `setting` needs for `tok_s`, whether a cycle can emit it, else the shallowest chain where it fits."""
    need = cm.tau_for(tok_s, setting)
    row = {
        "tok_s": tok_s,
        "speedup": tok_s / cm.baseline_tok_s,
        "setting": setting.key,
        "tau_needed": need,
        "max_tau": max_tau(setting),
    }
    row["reachable"] = need <= row["max_tau"]
    if not row["reachable"]:
        fits = [c for c in candidates if cm.tau_for(tok_s, c) <= max_tau(c)]
        row["needed_setting"] = fits[0].key if fits else None
        row["needed_setting_tau"] = cm.tau_for(tok_s, fits[0]) if fits else None
        # verify_time is flat beyond the largest measured size: a deeper setting's cycle is then a lower bound
        row["extrapolated"] = bool(fits) and fits[0].num_draft_tokens > max(cm.verify_s)
    return row


def reach_text(r: dict) -> str:
    head = f"{r['tok_s']:.1f} tok/s (x{r['speedup']:.2f}) needs tau {r['tau_needed']:.2f} at {r['setting']}"
    if r["reachable"]:
        return f"{head}, within its maximum {r['max_tau']}"
    out = f"{head}: out of reach, a {r['setting']} cycle emits at most {r['max_tau']} tokens"
    if r.get("needed_setting"):
        out += (
            f"; the shallowest chain where it fits is {r['needed_setting']} (tau {r['needed_setting_tau']:.2f} needed"
        )
        out += ", verify cost extrapolated beyond the measured sizes)" if r.get("extrapolated") else ")"
    else:
        out += f"; no chain up to {CHAINS[-1].key} reaches it at these costs"
    return out


def cost_model_from_summary(summary: dict) -> CostModel:
    """The cost model measured by eval/bench/live.py (bench/summary.json's `costs`)."""
    c = summary["costs"]
    return CostModel(
        baseline_s_per_token=c["baseline_s_per_token"],
        verify_s={int(k): v for k, v in c["verify_s"].items()},
        draft_forward_s=c.get("draft_forward_s") or 0.0,
        overhead_s=c.get("overhead_s") or 0.0,
        block=bool(c.get("block")),
    )


def fmt(x, spec="{:.2f}") -> str:
    """A figure for the tables, "-" where there is none."""
    return "-" if x is None else spec.format(x)
