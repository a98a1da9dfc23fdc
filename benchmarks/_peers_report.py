"""Tables, verdicts and plots of `peers.py`, computed from the workers' JSON only."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tabulate import tabulate

MiB = 2 ** 20
OTHERS = ("none", "per_block", "chen_sqrt")
GOOD = ("bitwise", "close")


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.3f}"


def _pct(row: dict, step_flops: int) -> str:
    if "recompute" not in row:
        return "-"
    return f"{row['recompute'] / 1e9:.3f} ({100 * row['recompute'] / max(step_flops, 1):.1f}%)"


def _fixed(result: dict) -> dict[str, dict]:
    return {r["strategy"]: r for r in result["rows"] if r["strategy"] in OTHERS}


def _remat(result: dict) -> dict[int, dict]:
    return {r["budget"]: r for r in result["rows"] if r["strategy"] == "remat"}


def _torch_runs(result: dict) -> dict[float, dict]:
    return {r["param"]: r for r in result["rows"] if r["strategy"] == "torch_budget"}


def _torch_chosen(result: dict) -> dict[int, dict | None]:
    runs = _torch_runs(result)
    return {r["budget"]: (None if r["chosen"] is None else runs[r["chosen"]])
            for r in result["rows"] if r["strategy"] == "torch_budget@budget"}


def _fits(row: dict | None, budget: int) -> bool:
    return row is not None and "peak" in row and row["peak"] <= budget


def _competitors(result: dict, budget: int) -> dict[str, dict]:
    """The other strategies whose measured peak fits `budget`."""
    found = {name: row for name, row in _fixed(result).items() if _fits(row, budget)}
    chosen = _torch_chosen(result).get(budget)
    if _fits(chosen, budget):
        found[f"torch@{chosen['param']:g}"] = chosen
    return found


_ORDER = {"none": 0, "per_block": 1, "chen_sqrt": 2, "torch_budget": 3, "remat_blocks": 4,
          "remat": 5}


def _calls(row: dict) -> str:
    """Compiled graphs that ran during the measured step: proof that the modes saw them."""
    calls = row.get("graph_calls")
    return f"{calls['forward']}/{calls['backward']}" if calls else ""


def configurations_table(result: dict) -> str:
    """Every configuration measured, whatever the budget: the raw data the checks use."""
    flops = result["step_flops"]
    measured = sorted((r for r in result["rows"] if r["strategy"] in _ORDER),
                      key=lambda r: (_ORDER[r["strategy"]], r.get("param", 0), r.get("budget", 0)))
    rows, how = [], {}
    for r in measured:
        setting = (f"budget {_mib(r['budget'])}" if "budget" in r
                   else f"fraction {r['param']:g}" if "param" in r else "")
        if r["strategy"] in OTHERS and r.get("how"):
            how[r["strategy"]] = r["how"]
        rows.append([r["strategy"], setting, _mib(r.get("peak")),
                     _mib(r.get("predicted")) if "predicted" in r else "",
                     _pct(r, flops), r.get("grads", ""),
                     f"{r['max_grad_diff']:.1e}" if r.get("max_grad_diff") else "",
                     f"{r['seconds']:.3f}" if "seconds" in r else "", _calls(r),
                     r.get("status", "") or r.get("error", "")])
    table = tabulate(rows, headers=["strategy", "setting", "peak MiB", "predicted MiB",
                                    "recompute GFLOP (% of step)", "grads", "max |dg|",
                                    "step s", "graphs fw/bw", "status / error"])
    how["remat_blocks"] = ("remat's own checkpoint_blocks schedule through remat's rewrite; a "
                           "diagnostic beside per_block, not a competitor")
    how["torch_budget"] = ("torch.compile + AOTAutograd min-cut partitioner under "
                           "activation_memory_budget=fraction, graphs run op by op (boxed_nop)")
    return table + "".join(f"\n  {name}: {text}" for name, text in how.items())


def budget_table(result: dict) -> str:
    flops = result["step_flops"]
    remat, chosen, fixed = _remat(result), _torch_chosen(result), _fixed(result)
    rows = []
    for budget in result["budgets"]:
        r = remat.get(budget, {})
        t = chosen.get(budget)
        cells = [_mib(budget), _mib(r.get("peak")) if "peak" in r else r.get("error", "-")[:30],
                 _pct(r, flops), r.get("grads", "")]
        cells += ["-", "-", "-", ""] if t is None else [
            f"{t['param']:g}", _mib(t["peak"]), _pct(t, flops), t.get("grads", "")]
        for name in OTHERS:
            row = fixed.get(name)
            cells.append(_pct(row, flops) if _fits(row, budget) else "does not fit")
        cells.append(check_budget(result, budget).text)
        rows.append(cells)
    return tabulate(rows, headers=["budget MiB", "remat peak", "remat recompute", "grads",
                                   "torch frac", "torch peak", "torch recompute", "grads",
                                   *OTHERS, "check"])


@dataclass
class Check:
    ok: bool
    text: str
    relevant: bool = True  # some other strategy with right gradients fits this budget


def check_budget(result: dict, budget: int) -> Check:
    """remat fits wherever another strategy fits, with recompute FLOPs no higher than the
    cheapest of them that keeps eager's gradients. Cheaper strategies with wrong gradients are
    named, not counted."""
    r = _remat(result).get(budget)
    others = _competitors(result, budget)
    right = {k: v for k, v in others.items() if v.get("grads") in GOOD}
    wrong = {k: v for k, v in others.items() if v.get("grads") not in GOOD}
    if not _fits(r, budget):
        if right:
            return Check(False, f"LOSS: remat does not fit, {', '.join(right)} do")
        return Check(True, "nobody fits" if not others else "only wrong-grad fits", False)
    if r.get("grads") not in GOOD:
        return Check(False, "LOSS: remat gradients wrong")
    note = ""
    cheaper_wrong = [k for k, v in wrong.items() if v["recompute"] < r["recompute"]]
    if cheaper_wrong:
        note = f" ({', '.join(cheaper_wrong)} cheaper, wrong grads)"
    if not right:
        return Check(True, "ok, remat only" + note, False)
    best_name, best = min(right.items(), key=lambda kv: kv[1]["recompute"])
    if r["recompute"] <= best["recompute"]:
        return Check(True, f"ok (<= {best_name})" + note)
    return Check(False, f"LOSS: {best_name} recomputes less" + note)


# A check that remat misses and that no schedule of its execution model can meet, proven by
# remat.solvers.relaxation.bound independently of remat's search: reported, not counted as remat's
# failure.
PASS, FAIL, UNATTAINABLE = "PASS", "FAIL", "UNATTAINABLE"


def _mark(ok: bool) -> str:
    return PASS if ok else FAIL


def verdict(result: dict) -> list[tuple[str, str]]:
    remat = _remat(result)
    fixed = _fixed(result)
    lines = []

    checks = [check_budget(result, b) for b in result["budgets"]]
    relevant = [c for c in checks if c.relevant]
    lines.append((_mark(all(c.ok for c in checks)),
                  f"fits with no more recompute wherever another strategy with right gradients "
                  f"fits: {sum(c.ok for c in relevant)}/{len(relevant)} budgets"))

    block = fixed.get("per_block")
    at_block = remat.get(block.get("peak")) if block else None
    bounds = result.get("bounds", {})
    if block is None or "peak" not in block:
        lines.append((FAIL, "per-block checkpointing was not measured"))
    elif not _fits(at_block, block["peak"]):
        lines.append((FAIL, f"at per-block's peak ({_mib(block['peak'])} MiB) remat does not "
                            f"fit: {at_block.get('error', '') if at_block else 'not run'}"))
    else:
        half = 0.5 * block["recompute"]
        least = bounds.get("flops_at_per_block") if bounds.get("per_block_peak") == block["peak"] \
            else None
        proof = ("" if not least else
                 f"; no schedule of the traced order can recompute less than "
                 f"{least / 1e9:.3f} GFLOP there (proven at {bounds['flops_at']})")
        mark = PASS if at_block["recompute"] <= half else (
            UNATTAINABLE if least is not None and least > half else FAIL)
        lines.append((mark, f"at per-block's peak ({_mib(block['peak'])} MiB): remat recomputes "
                            f"{at_block['recompute'] / 1e9:.3f} GFLOP vs per-block "
                            f"{block['recompute'] / 1e9:.3f} (needs <= half){proof}"))

    remat_min = min((r["peak"] for r in remat.values() if "peak" in r and r.get("grads") in GOOD),
                    default=None)
    others = [r for r in result["rows"]
              if r["strategy"] not in ("remat", "remat_blocks") and "peak" in r]
    other_min = min((r["peak"] for r in others if r.get("grads") in GOOD), default=None)
    wrong_min = min((r["peak"] for r in others if r.get("grads") not in GOOD), default=None)
    if remat_min is None:
        lines.append((FAIL, "remat never ran successfully"))
    else:
        wrong = (f"; {_mib(wrong_min)} MiB with wrong gradients"
                 if wrong_min is not None and wrong_min < min(remat_min, other_min or wrong_min + 1)
                 else "")
        floor = bounds.get("peak")
        proof = "" if not floor else f"; no schedule peaks below {_mib(floor)} MiB (proven)"
        lines.append((_mark(other_min is None or remat_min <= other_min),
                      f"smallest measured peak with right gradients: remat {_mib(remat_min)} MiB, "
                      f"others {_mib(other_min)} MiB{wrong} (remat's solver says "
                      f"{_mib(result['remat_smallest'])}){proof}"))

    ran = [r for r in remat.values() if "peak" in r]
    over = [r for r in ran if r["peak"] > r["budget"]]
    bad = [r for r in ran if r.get("grads") not in GOOD]
    failed = len(remat) - len(ran)
    lines.append((_mark(not over and not bad),
                  f"remat's measured peak over its budget at {len(over)} of the {len(ran)} budgets "
                  f"it planned, gradients differ from eager's at {len(bad)}"
                  + (f"; no plan at {failed} budgets" if failed else "")))
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flops = max(result["step_flops"], 1)

    def xy(rows):
        rows = sorted((r for r in rows if "peak" in r), key=lambda r: r["peak"])
        return [r["peak"] / MiB for r in rows], [100 * r["recompute"] / flops for r in rows], rows

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x, y, _ = xy(_remat(result).values())
    ax.plot(x, y, "o-", color="C0", label="remat optimal (per budget)")
    x, y, rows = xy(_torch_runs(result).values())
    good = [r.get("grads") in GOOD for r in rows]
    ax.scatter([a for a, g in zip(x, good) if g], [b for b, g in zip(y, good) if g], color="C1",
               marker="s", label="torch activation_memory_budget")
    ax.scatter([a for a, g in zip(x, good) if not g], [b for b, g in zip(y, good) if not g],
               facecolors="none", edgecolors="C1", marker="s",
               label="torch budget, WRONG gradients")
    for a, b, r in zip(x, y, rows):
        ax.annotate(f"{r['param']:g}", (a, b), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    for (name, row), (color, marker) in zip(_fixed(result).items(),
                                            [("k", "*"), ("C2", "^"), ("C3", "D")]):
        if "peak" in row:
            ax.scatter([row["peak"] / MiB], [100 * row["recompute"] / flops], color=color,
                       marker=marker, s=80, label=name, zorder=3)
    for row in result["rows"]:
        if row["strategy"] == "remat_blocks" and "peak" in row:
            ax.scatter([row["peak"] / MiB], [100 * row["recompute"] / flops], color="grey",
                       marker="x", s=60, label="remat's per-block schedule (diagnostic)")
    ax.set_xlabel("measured activation peak (MiB)")
    ax.set_ylabel("recompute FLOPs (% of the step's)")
    ax.set_title(f"{result['model']}{' (quick)' if result['quick'] else ''}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(result: dict, out: str) -> str:
    name = result["model"]
    if "crash" in result:
        return f"== {name}: the worker crashed ==\n{result['crash']}"
    text = [f"== {name}: {result['params']:,} parameters, inputs {result['inputs']}, step "
            f"{result['step_flops'] / 1e9:.3f} GFLOP, save-all peak "
            f"{_mib(result['save_all_peak'])} MiB, torch {result['torch']}, "
            f"remat solver {result.get('time_limit', '?')} s per budget minimizing FLOPs, "
            f"{result['seconds']:.0f} s ==",
            configurations_table(result), "", budget_table(result), "", "verdict:"]
    text += [f"  [{mark}] {line}" for mark, line in verdict(result)]
    path = os.path.join(out, f"peers_{name}.png")
    plot(result, path)
    text.append(f"  plot: {path}")
    return "\n".join(text)
