"""The report of a tuning study (launcher/tune_sweeper.py; `llaunch-report <sweep dir>` redraws it):

    <tuned_dir>/tuned/<study>.yaml   the best trial's config as a profile: `llaunch --config-dir <tuned_dir> +tuned=<study>`
    <sweep dir>/tune.md              a table of every trial (score, parameters, figures, why a trial scored 0)
    <sweep dir>/tune.png             score over trials, parameter importance, goodput vs TTFT p99 frontier

The profile holds the study's fixed overrides (model, device, ...) and the best trial's parameters, not
the bench profile: it serves the tuned config; `bench=...` on top benchmarks it again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape

from llaunch.launcher.report_table import Table, to_markdown, to_rich

FIGURES = (("output_throughput", "output tok/s", ".1f"), ("p99_ttft_ms", "TTFT p99 (ms)", ".1f"),
           ("p99_tpot_ms", "TPOT p99 (ms)", ".2f"))
NOT_SERVING = ("bench", "hydra", "tuned", "dry_run")  # override keys that do not belong in a serving profile


@dataclass(frozen=True)
class Trial:
    number: int
    state: str  # Optuna's: COMPLETE, FAIL (the job raised), RUNNING (interrupted)
    score: Optional[float]
    params: dict[str, Any]
    fixed: dict[str, Any]  # the study's other overrides (Optuna's user attributes)
    status: dict  # the job's status.json ({} when it has none)
    bench: dict  # its bench.json ({} when it has none)


def load_trials(study, sweep_dir: Path) -> list[Trial]:
    trials = []
    for t in study.trials:
        job = sweep_dir / str(t.number)
        status = json.loads((job / "status.json").read_text()) if (job / "status.json").exists() else {}
        bench = json.loads((job / "bench.json").read_text()) if (job / "bench.json").exists() else {}
        trials.append(Trial(t.number, t.state.name, t.value, dict(t.params), dict(t.user_attrs), status, bench))
    return trials


def _key(override_key: str) -> str:
    return override_key.lstrip("+~")


def profile_yaml(trial: Trial, study_name: str, n_trials: int, tuned_dir: Path) -> str:
    """A `# @package _global_` profile: group choices as defaults-list overrides, the rest as keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from llaunch.launcher import store

    body, groups = OmegaConf.create(), []
    parser = OverridesParser.create()
    for key, value in {**trial.fixed, **trial.params}.items():
        name = _key(key)
        if key.startswith("~") or name.split(".")[0].split("/")[0] in NOT_SERVING or name.startswith("llaunch_"):
            continue
        if name in store.GROUPS or "/" in name:
            groups.append(f"  - override /{name}: {value}")
            continue
        parsed = parser.parse_override(f"{name}={value}")
        OmegaConf.update(body, name, parsed.value(), force_add=True)
    bench = trial.bench.get("args", {})
    header = [
        "# @package _global_",
        f"# Tuned by llaunch (hydra/sweeper=tune): study {study_name}, best of {n_trials} trials: trial "
        f"{trial.number}, score {trial.score:.4g} req/s",
        f"# workload: {bench.get('num_prompts')} prompts, input {bench.get('input_len')} / output "
        f"{bench.get('output_len')} tokens, concurrency {bench.get('concurrency')}, SLOs TTFT "
        f"{bench.get('slo_ttft_ms')} ms, TPOT {bench.get('slo_tpot_ms')} ms, trace {bench.get('trace')}",
        f"# serve it: llaunch --config-dir {tuned_dir} +tuned={study_name}",
    ]
    defaults = ["defaults:", *groups] if groups else []
    return "\n".join([*header, *defaults]) + "\n" + (OmegaConf.to_yaml(body) if len(body) else "")


def trials_table(trials: list[Trial]) -> Table:
    keys = list(dict.fromkeys(k for t in trials for k in t.params))
    header = ["trial", *keys, "score (req/s)", *(label for _, label, _ in FIGURES), "why 0 / failed"]
    rows = []
    for t in trials:
        score = "—" if t.score is None else f"{t.score:.3f}"
        figures = [format(t.bench[k], fmt) if k in t.bench else "—" for k, _, fmt in FIGURES]
        why = t.status.get("reason") or t.status.get("objective_note") or ("" if t.state == "COMPLETE" else t.state)
        rows.append([str(t.number), *(str(t.params.get(k, "")) for k in keys), score, *figures, _gist(why)])
    return Table(header, rows, 1 + len(keys))


def _gist(reason: str) -> str:
    """A reason in one line: its first, and its last when the first only introduces it (a rule's message)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = f"{lines[0]} {lines[-1]}" if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return text if len(text) <= 240 else text[:239] + "…"


def importance(study, trials: list[Trial]) -> tuple[dict[str, float], str]:
    """Optuna's fANOVA importance when it runs here (it needs scikit-learn), else the spread of the mean
    score across each parameter's values (up to 4 quantile buckets for numbers), normalized to sum 1."""
    try:
        import optuna

        return dict(optuna.importance.get_param_importances(study)), "fANOVA importance (Optuna)"
    except Exception:  # scikit-learn missing, or too few complete trials
        pass
    done = [t for t in trials if t.score is not None]
    spreads = {}
    for key in dict.fromkeys(k for t in done for k in t.params):
        values = sorted({t.params[key] for t in done if key in t.params}, key=str)
        if all(isinstance(v, (int, float)) for v in values) and len(values) > 4:
            edges = [values[round(i * (len(values) - 1) / 4)] for i in range(5)]
            bucket = lambda v: sum(v > e for e in edges[1:-1])  # noqa: E731
        else:
            bucket = values.index
        means: dict[int, list[float]] = {}
        for t in done:
            if key in t.params:
                means.setdefault(bucket(t.params[key]), []).append(t.score)
        averages = [sum(s) / len(s) for s in means.values()]
        spreads[key] = max(averages) - min(averages) if averages else 0.0
    total = sum(spreads.values())
    return ({k: (v / total if total else 0.0) for k, v in spreads.items()},
            "spread of the mean score across each parameter's values (fANOVA needs scikit-learn)")


def frontier(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """(latency, goodput, trial) points no other point beats on both (lower latency, higher goodput)."""
    best, kept = float("-inf"), []
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if p[1] > best:
            kept.append(p)
            best = p[1]
    return kept


def plot(study, trials: list[Trial], path: Path) -> Optional[Path]:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, (over, imp, front) = plt.subplots(1, 3, figsize=(17, 4.5))
    scored = [t for t in trials if t.score is not None]
    over.scatter([t.number for t in scored], [t.score for t in scored], label="trial")
    running, best = [], float("-inf")
    for t in scored:
        best = max(best, t.score)
        running.append(best)
    over.step([t.number for t in scored], running, where="post", color="C1", label="best so far")
    over.set(xlabel="trial", ylabel="score: goodput (req/s)", title="score over trials")
    over.legend(fontsize="small")
    weights, method = importance(study, trials)
    names = sorted(weights, key=weights.get)
    imp.barh(names or ["(none)"], [weights[n] for n in names] or [0.0])
    imp.set(xlabel="importance", title="parameter importance")
    imp.text(0.0, -0.18, method, transform=imp.transAxes, fontsize="x-small")
    points = [(t.bench["p99_ttft_ms"], t.score, t.number) for t in scored if "p99_ttft_ms" in t.bench]
    front.scatter([p[0] for p in points], [p[1] for p in points], color="C0", label="trial")
    edge = frontier(points)
    front.plot([p[0] for p in edge], [p[1] for p in edge], color="C3", marker="o", label="frontier")
    for latency, score, number in edge:
        front.annotate(str(number), (latency, score), textcoords="offset points", xytext=(4, 4), fontsize="small")
    front.set(xlabel="TTFT p99 (ms)", ylabel="goodput (req/s)", title="goodput vs latency")
    front.legend(fontsize="small")
    for ax in (over, imp, front):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(study, sweep_dir: Path, tuned_dir: Path, console: Optional[Console] = None) -> Optional[Path]:
    """The table, the plots and (when a trial scored above 0) the best profile; returns the profile's path."""
    console = console or Console(stderr=True)
    trials = load_trials(study, sweep_dir)
    table = trials_table(trials)
    console.print(to_rich(table, f"study {study.study_name} ({sweep_dir})"))
    written = [sweep_dir / "tune.md"]
    profile = None
    scored = [t for t in trials if t.score is not None]
    best = max(scored, key=lambda t: t.score, default=None)
    summary = "no trial finished"
    if best is not None and best.score > 0:
        profile = tuned_dir / "tuned" / f"{study.study_name}.yaml"
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.write_text(profile_yaml(best, study.study_name, len(trials), tuned_dir))
        written.insert(0, profile)
        summary = f"best: trial {best.number}, score {best.score:.4g} req/s ({best.params})"
        console.print(f"[bold green]{escape(summary)}[/]\nserve it: llaunch --config-dir {escape(str(tuned_dir))} "
                      f"+tuned={escape(study.study_name)}")
    elif best is not None:
        summary = "no trial scored above 0 (every one failed or missed the SLOs): no profile written"
        console.print(f"[bold red]{summary}[/]")
    (sweep_dir / "tune.md").write_text(f"# Study `{study.study_name}`\n\n{summary}\n\n{to_markdown(table)}")
    png = plot(study, trials, sweep_dir / "tune.png")
    if png is not None:
        written.append(png)
    console.print("wrote " + ", ".join(escape(str(p)) for p in written))
    return profile


def quiet_optuna_imports() -> None:
    """optuna 2.10 on SQLAlchemy 1.4 warns about 2.0 (pinned below 2): nothing a user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message="Deprecated API features detected")


def report_dir(sweep_dir: Path, console: Console) -> int:
    """`llaunch-report` on a tuning sweep: the study in <sweep dir>/study.db, reported again."""
    quiet_optuna_imports()
    import optuna

    storage = f"sqlite:///{sweep_dir.resolve() / 'study.db'}"
    summaries = optuna.get_all_study_summaries(storage)
    for summary in summaries:
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        write(study, sweep_dir, sweep_dir, console)
    return 0 if summaries else 1
