"""What the launcher tells a person: rule violations, dry-run warnings and pending checks (stderr),
and the planned process graph as a tree (stdout)."""
from __future__ import annotations

from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from llaunch.launcher.rule_registry import Pending, Violation
from llaunch.runtime.config import ProcessSpec, RunConfig

err = Console(stderr=True, soft_wrap=True)


def _stdout() -> Console:
    console = Console()  # piped (tests, grep): wide enough that no address is wrapped or cropped
    return console if console.is_terminal else Console(width=10_000)


out = _stdout()


def print_violations(violations: list[Violation]) -> None:
    n = len(violations)
    err.print(f"[bold red]llaunch: invalid configuration[/] ({n} rule{'s' * (n != 1)} violated; nothing started)")
    for v in violations:
        err.print(f"  [red]✗[/] [bold]{v.rule}[/] [dim]({', '.join(v.keys)})[/]\n    {escape(v.message)}")


def print_error(title: str, message: str) -> None:
    err.print(f"[bold red]llaunch: {escape(title)}[/]\n  {escape(message)}")


def print_dry_run_notes(warnings: list[Violation], pending: list[Pending]) -> None:
    for w in warnings:
        err.print(f"[yellow]warning[/] [bold]{w.rule}[/] [dim]({', '.join(w.keys)})[/]: {escape(w.message)} "
                  "[dim](a real start would refuse this)[/]")
    waiting = [p for p in pending if p.reason.startswith("waits")]
    for reason in dict.fromkeys(p.reason for p in waiting):
        rules = [f"{p.rule} ({', '.join(p.keys)})" for p in waiting if p.reason == reason]
        err.print(f"[cyan]pending[/] {reason}: {escape('; '.join(rules))}")
    skipped = [p.rule for p in pending if not p.reason.startswith("waits")]
    if skipped:
        err.print(f"[cyan]skipped[/] (they check this machine, a dry run plans for any): {', '.join(skipped)}")


def _spec_label(spec: ProcessSpec, multinode: bool) -> str:
    where = f"GPU {', '.join(map(str, spec.gpus))}" if spec.gpus else "no GPU"
    node = f", node {spec.node}" if multinode else ""
    return f"[bold]{spec.name}[/] [magenta]{spec.role}[/] [dim]({where}{node})[/]"


def _endpoints(tree: Tree, arrow: str, items: Iterable[tuple[str, str]]) -> None:
    for key, addr in items:
        tree.add(f"{arrow} [green]{escape(key)}[/] {escape(addr)}")


def graph_tree(cfg: RunConfig) -> Tree:
    g, m = cfg.graph, cfg.model
    tree = Tree(f"[bold]llaunch[/] {cfg.mode.kind.value} · {m.name} ({m.family}, {m.load_format.value}, "
                f"{m.dtype.value}) · {cfg.device.value} · tp={cfg.parallel.tp} dp={cfg.parallel.dp} · "
                f"{g.http_url}")
    tree.add(f"[dim]run dir[/] {escape(cfg.run_dir)}")
    tree.add(f"[dim]control[/] {escape(g.control)}")
    if getattr(m.task, "value", m.task) == "score":  # model.task=score: no generation routes
        form = m.score_head.value if m.score_head is not None else "linear"
        tree.add(f"[dim]score head[/] {form}, {m.num_labels} output(s) {escape(str(m.labels))}: "
                 "/get_score, /classify, /v1/score" + (", /v1/rerank" if m.num_labels == 1 else ""))
    if getattr(m.task, "value", m.task) == "embed":  # model.task=embed: no generation routes
        size = f"{m.hidden_size}" + (" (Matryoshka: fewer on request)" if m.matryoshka else "")
        tree.add(f"[dim]embeddings[/] {m.pooling.value if m.pooling else '?'} pooling, "
                 f"{'normalized' if m.normalize else 'not normalized'}, {size} values: /v1/embeddings")
    spec = getattr(cfg, "spec", None)
    if spec is not None and spec.method.value != "none":  # runtime/router/spec_decode.py
        draft = getattr(cfg, "draft_model", None)
        source = (f"the draft model {escape(draft.path)}, in every worker" if draft is not None
                  else f"suffixes of {spec.ngram_max}..{spec.ngram_min} tokens"
                  + ("; a greedy row's verifies chained" if getattr(spec, "chain", False) else "")
                  + ("; proposals as long as each row recently accepted" if getattr(spec, "adaptive", False) else ""))
        tree.add(f"[dim]speculative decoding[/] {spec.method.value}: {spec.num_tokens} proposed tokens per row and "
                 f"step ({source}), off above {spec.max_batch} decode rows")
    if cfg.parallel.cuda_mps:
        tree.add("[dim]cuda mps daemon[/] nvidia-cuda-mps-control -d, its pipe in a private directory under the "
                 "temp dir (started first, quit last)")
    multinode = cfg.parallel.nnodes > 1
    for spec in g.processes:
        node = tree.add(_spec_label(spec, multinode))
        _endpoints(node, "binds   ", spec.binds.items())
        _endpoints(node, "connects", spec.connects.items())
    return tree


def print_graph(cfg: RunConfig) -> None:
    out.print(graph_tree(cfg))
