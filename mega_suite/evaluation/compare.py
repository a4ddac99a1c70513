"""Compare finished runs: ``python -m mega_suite.evaluation.compare RUN_DIR RUN_DIR ... [--out DIR] [--group-by-seed]``.

Reads each run directory's TensorBoard event files (the scalars the suite logs: ``train/loss`` every
``log_every_n_steps``, ``val/*`` and ``test/*`` at every validation) and writes ``compare.md`` (a Markdown
table of final and best metrics, steps, tokens seen and wall time per run) and ``compare.png`` (training and
validation loss against tokens seen and against wall time) into ``--out``.

- **Tokens seen** at a logged step ``s``: the value of a logged tokens counter (tag ``train/tokens_seen``)
  when the run logs one; otherwise ``s x tokens per step`` with, from the run's resolved ``config.yaml``,
  ``tokens per step = data.batch_size x seq_len x accumulate_grad_batches x devices x num_nodes``
  (``seq_len = data.options.seq_len``, else ``data.max_length``, an upper bound for padded batches;
  accumulation recomputed from ``trainer.global_batch_tokens`` when that is set, as the runner does;
  ``devices=auto`` counts as 1). Lightning logs both at the index ``s`` of the batch just trained: a
  training loss at ``s`` was computed by a model that had seen ``s`` batches, a validation at ``s`` follows
  ``s + 1`` optimizer steps, so their ``x`` is ``s`` and ``s + 1`` batches of tokens respectively.
  The table says which source each run used.
- **Training tokens/s**: the median of the logged ``train/device/items_per_sec`` (per device), when logged.
- **Wall time**: seconds from the run's first event (its logger's creation, after data preparation) to
  each event; a resumed run's pause between sessions is included.
- **mode=lm_eval runs** (each with ``lm_eval.json``): ``lm_eval_compare.md``, their harness scores side by
  side, a column per run.
- **``--group-by-seed``**: runs whose ``config.yaml`` agree on everything but ``seed`` (and the run
  directory) form one row and one curve: the mean over seeds with a min/max band (on the steps every
  member logged); table cells read ``mean [min, max]``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf

from mega_suite.errors import UserError

TOKEN_TAG = "train/tokens_seen"
TRAIN_LOSS = "train/loss"
# Lightning's ThroughputMonitor: valid tokens per second per device over the last log_every_n_steps steps.
THROUGHPUT = "train/device/items_per_sec"
# Evaluation metrics reported when present, with the direction that is better.
EVAL_METRICS: dict[str, Callable[[Sequence[float]], float]] = {
    "loss": min,
    "ppl": min,
    "word_ppl": min,
    "acc": max,
}
# Keys that differ between the seeds of one experiment without making it a different experiment.
RUN_KEYS = ("seed", "run_dir", "run_root", "resume", "ckpt")


class CompareError(UserError):
    """A run directory that cannot be compared; the message names it and says what was expected."""


@dataclass
class Curve:
    """One scalar of one run: ``steps[i]`` ascending, ``values[i]``, ``wall[i]`` seconds since the run start."""

    steps: np.ndarray
    values: np.ndarray
    wall: np.ndarray


@dataclass
class Run:
    path: Path
    label: str
    config: dict
    curves: dict[str, Curve]
    tokens_per_step: float | None = None
    tokens_note: str = ""
    members: list[Run] = field(default_factory=list)  # a seed group's runs; empty for a single run
    bands: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # tag -> (min, max)

    def tokens(self, steps: np.ndarray, tag: str = TRAIN_LOSS) -> np.ndarray:
        """Tokens the model had seen when ``tag`` was logged at ``steps`` (see the module docstring)."""
        if TOKEN_TAG in self.curves:
            counter = self.curves[TOKEN_TAG]
            return np.interp(steps, counter.steps, counter.values)
        return (np.asarray(steps, dtype=np.float64) + steps_after(tag)) * self.tokens_per_step

    @property
    def seeds(self) -> list:
        return [m.config.get("seed") for m in self.members] or [self.config.get("seed")]


def steps_after(tag: str) -> int:
    """Optimizer steps done when ``tag`` is logged at step ``s``, minus ``s``: 0 for a training metric (computed
    before the update of batch ``s``), 1 for an evaluation (after it)."""
    return 0 if tag.startswith("train/") else 1


# ---------------------------------------------------------------------------------------------- reading
def read_scalars(path: Path) -> tuple[dict[str, Curve], float]:
    """Every scalar of a run directory's event files, one value per step (the last written wins: a resumed
    run re-logs the steps after its last checkpoint), and the time of its first event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(path.glob("events.out.tfevents.*"))
    if not files:
        raise CompareError(
            f"{path}: no TensorBoard event files (events.out.tfevents.*); is it a run directory?"
        )
    raw: dict[str, dict[int, tuple[float, float]]] = {}
    start = math.inf
    for file in files:
        accumulator = EventAccumulator(str(file), size_guidance={"scalars": 0})
        try:
            accumulator.Reload()
            start = min(start, accumulator.FirstEventTimestamp())
        except (OSError, ValueError) as exc:  # ValueError: the file holds no readable event
            raise CompareError(f"{file}: unreadable TensorBoard event file ({exc})") from None
        for tag in accumulator.Tags()["scalars"]:
            per_step = raw.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                if event.step not in per_step or event.wall_time >= per_step[event.step][0]:
                    per_step[event.step] = (event.wall_time, event.value)
    curves = {}
    for tag, per_step in raw.items():
        steps = np.array(sorted(per_step), dtype=np.int64)
        wall = np.array([per_step[s][0] - start for s in steps])
        curves[tag] = Curve(steps, np.array([per_step[s][1] for s in steps], dtype=np.float64), wall)
    return curves, start


def tokens_per_step(config: dict, source: Path) -> tuple[float, str]:
    """Training tokens per optimizer step of a run and how they were counted: its ``plan.json`` when it has one
    (what the run itself used), else its resolved configuration through the same formula
    (``mega_suite.config.resolve.tokens_per_step``)."""
    plan = source.parent / "plan.json"
    if plan.is_file():
        try:
            recorded = json.loads(plan.read_text())
            if recorded.get("tokens_per_step"):
                return float(recorded["tokens_per_step"]), f"{recorded['tokens_per_step_how']} (plan.json)"
        except (OSError, ValueError, KeyError):
            pass
    from mega_suite.config.resolve import tokens_per_step as formula
    from mega_suite.config.schema import RunConfig

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(config))
        result = formula(cfg, devices=_devices(cfg.trainer.devices))
    except Exception as exc:  # noqa: BLE001  (an older or hand-edited config.yaml)
        raise CompareError(
            f"{source}: cannot compute tokens per step ({' '.join(str(exc).split())[:160]})"
        ) from None
    if result is None:
        raise CompareError(f"{source}: the run's data has no sequence length to count tokens per step")
    total, how = result
    return total, f"{how} (config.yaml)"


def _devices(devices) -> int:
    """``trainer.devices`` of a finished run as a count (``auto`` counts as 1: the host that compares may
    have no GPU)."""
    if isinstance(devices, int):
        return devices
    if isinstance(devices, list) or OmegaConf.is_list(devices):
        return len(devices)
    return int(devices) if str(devices).isdigit() else 1


def load_run(path: str | Path) -> Run:
    """A finished (or stopped) run directory: its scalars, configuration and tokens per step."""
    path = Path(path)
    if not path.is_dir():
        raise CompareError(f"{path}: not a directory (expected a run directory runs/<recipe>/<time>/)")
    curves, _ = read_scalars(path)
    if TRAIN_LOSS not in curves:
        raise CompareError(f"{path}: its event files hold no {TRAIN_LOSS} scalars (did the run train?)")
    config_path = path / "config.yaml"
    config: dict = {}
    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise CompareError(f"{config_path}: unreadable ({exc})") from None
        if not isinstance(config, dict):
            raise CompareError(f"{config_path}: expected a mapping (the resolved run configuration)")
    label = f"{path.parent.name}/{path.name}"
    run = Run(path, label, config, curves)
    if TOKEN_TAG in curves:
        run.tokens_note = f"tokens from the logged counter {TOKEN_TAG}"
    elif config:
        run.tokens_per_step, run.tokens_note = tokens_per_step(config, config_path)
    else:
        raise CompareError(
            f"{path}: no config.yaml and no {TOKEN_TAG} scalars, so the tokens seen are unknown "
            "(expected the resolved config.yaml the runner writes into every run directory)"
        )
    return run


# ---------------------------------------------------------------------------------------------- seeds
def experiment_key(config: dict) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in RUN_KEYS}, sort_keys=True, default=str)


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif f"{prefix}{k}" not in RUN_KEYS:
            out[f"{prefix}{k}"] = v
    return out


def differing_keys(configs: dict[str, dict]) -> dict[str, list[tuple[str, object]]]:
    """Per experiment, the dotted ``(key, value)`` pairs on which the experiments disagree (a key one of
    them lacks counts as different), so that groups of one recipe get distinct labels."""
    flat = {name: _flat(config) for name, config in configs.items()}
    keys = sorted(set().union(*flat.values())) if flat else []
    missing = object()
    varying = [k for k in keys if len({repr(f.get(k, missing)) for f in flat.values()}) > 1]
    return {name: [(k, f.get(k)) for k in varying] for name, f in flat.items()}


def with_differences(run: Run, differences: list[tuple[str, object]]) -> Run:
    """``run`` with the keys that set it apart from the other runs appended to its label."""
    if differences:
        run.label += " " + " ".join(f"{k}={v}" for k, v in differences)
    return run


def group_by_seed(runs: list[Run]) -> list[Run]:
    """Runs with equal configurations but for the seed become one run whose curves are the mean over the
    members on the steps all of them logged, with (min, max) bands; single runs pass through."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(experiment_key(run.config), []).append(run)
    distinguishing = differing_keys({key: members[0].config for key, members in groups.items()})
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.append(with_differences(members[0], distinguishing[experiment_key(members[0].config)]))
            continue
        first = members[0]
        curves, bands = {}, {}
        tags = set.intersection(*(set(m.curves) for m in members))
        for tag in sorted(tags):
            steps = first.curves[tag].steps
            for m in members[1:]:
                steps = np.intersect1d(steps, m.curves[tag].steps)
            if steps.size == 0:
                continue
            values = np.stack(
                [m.curves[tag].values[np.searchsorted(m.curves[tag].steps, steps)] for m in members]
            )
            wall = np.stack(
                [m.curves[tag].wall[np.searchsorted(m.curves[tag].steps, steps)] for m in members]
            )
            curves[tag] = Curve(steps, values.mean(0), wall.mean(0))
            bands[tag] = (values.min(0), values.max(0))
        seeds = ",".join(str(m.config.get("seed")) for m in members)
        differs = " ".join(f"{k}={v}" for k, v in distinguishing[experiment_key(first.config)])
        name = first.config.get("recipe", first.path.parent.name)
        label = f"{name} {differs} (seeds {seeds})" if differs else f"{name} (seeds {seeds})"
        out.append(
            Run(
                first.path,
                label,
                first.config,
                curves,
                first.tokens_per_step,
                first.tokens_note,
                members,
                bands,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------- table
def summary(run: Run) -> dict[str, float]:
    """Scalar facts of one (single) run: steps, tokens, wall time, final train loss, per evaluation metric
    the final and best validation value (with its step) and the test value at that step."""
    loss = run.curves[TRAIN_LOSS]
    steps = max(int(c.steps[-1]) + 1 for t, c in run.curves.items() if t.startswith(("train/", "val/")))
    out = {
        "steps": float(steps),
        "tokens": float(run.tokens(np.array([steps - 1]), "val/loss")[0]),
        "wall time": float(max(c.wall[-1] for c in run.curves.values())),
        "train/loss final": float(loss.values[-1]),
    }
    throughput = run.curves.get(THROUGHPUT)
    if throughput is not None:
        out["train tokens/s"] = float(np.median(throughput.values))
    for metric, better in EVAL_METRICS.items():
        val = run.curves.get(f"val/{metric}")
        if val is None:
            continue
        best = better(val.values)
        i = int(np.flatnonzero(val.values == best)[0])
        out[f"val/{metric} final"] = float(val.values[-1])
        out[f"val/{metric} best"] = float(best)
        out[f"val/{metric} best step"] = float(val.steps[i] + 1)
        test = run.curves.get(f"test/{metric}")
        if test is not None and val.steps[i] in test.steps:
            out[f"test/{metric} @ best val"] = float(test.values[np.searchsorted(test.steps, val.steps[i])])
    return out


def _number(x: float) -> str:
    if abs(x) >= 1e5:
        return f"{x:.3g}"
    return f"{x:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def _cell(values: list[float], fmt: Callable[[float], str]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return ""
    if fmt(min(values)) == fmt(max(values)):  # equal as shown (e.g. wall times a few ms apart)
        return fmt(float(np.mean(values)))
    return f"{fmt(float(np.mean(values)))} [{fmt(min(values))}, {fmt(max(values))}]"


def table(runs: list[Run]) -> str:
    """The Markdown report: one row per run or seed group, then how tokens were counted."""
    per_run = [[summary(m) for m in (r.members or [r])] for r in runs]
    keys = [k for k in per_run[0][0]]
    for rows in per_run[1:]:
        keys += [k for k in rows[0] if k not in keys]
    keys = [k for k in keys if not k.endswith(" step")]
    header = ["run", "seed", *keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run, rows in zip(runs, per_run):
        cells = [run.label, ",".join(map(str, run.seeds))]
        for key in keys:
            values = [row.get(key, math.nan) for row in rows]
            if key == "wall time":
                cell = _cell(values, _duration)
            elif key in ("steps", "tokens"):
                cell = _cell(values, lambda v: f"{int(round(v)):,}")
            else:
                cell = _cell(values, _number)
            step_key = f"{key} step"
            if key.endswith(" best") and len(rows) == 1 and step_key in rows[0]:
                cell += f" (after {int(rows[0][step_key])} steps)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Tokens seen: " + "; ".join(f"{r.label}: {r.tokens_note}" for r in runs) + ".")
    lines.append("Wall time: from each run's first TensorBoard event to its last.")
    if any(r.members for r in runs):
        lines.append("Seed groups: mean [min, max] over the seeds.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- plot
def plot(runs: list[Run], path: Path, smooth: float = 0.0) -> None:
    """Training loss (solid) and validation loss (dashed, markers) against tokens seen and wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, run in enumerate(runs):
        color = f"C{k % 10}"
        for tag, style in ((TRAIN_LOSS, "-"), ("val/loss", "--o")):
            curve = run.curves.get(tag)
            if curve is None:
                continue
            values = _ema(curve.values, smooth) if tag == TRAIN_LOSS else curve.values
            tokens = run.tokens(curve.steps, tag)
            name = f"{run.label} {tag.split('/')[0]}"
            for ax, x in ((axes[0], tokens), (axes[1], curve.wall)):
                ax.plot(x, values, style, color=color, label=name, markersize=3, linewidth=1.2)
                if tag in run.bands:
                    low, high = run.bands[tag]
                    ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
    axes[0].set_xlabel("tokens seen")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("loss (nats / token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    title = "training (solid) and validation (dashed) loss"
    fig.suptitle(title + (f", training EMA-smoothed {smooth}" if smooth else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: ``s_i = w s_{i-1} + (1 - w) x_i``, debiased."""
    if weight <= 0:
        return values
    out, last, norm = np.empty_like(values), 0.0, 0.0
    for i, x in enumerate(values):
        last = weight * last + (1 - weight) * x
        norm = weight * norm + (1 - weight)
        out[i] = last / norm
    return out


# ---------------------------------------------------------------------------------------------- CLI
REPORT = ["compare.md", "compare.png"]


def compare(
    run_dirs: Sequence[str | Path],
    out: str | Path = ".",
    group_seeds: bool = False,
    smooth: float = 0.0,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """Write ``compare.md`` and ``compare.png`` for ``run_dirs`` into ``out`` (whole, never over existing ones
    unless ``overwrite``); returns their paths."""
    from mega_suite.storage.atomic import new_files

    if not run_dirs:
        raise CompareError("no run directories given")
    if not 0.0 <= smooth < 1.0:
        raise CompareError(f"--smooth must be in [0, 1), got {smooth}")
    runs = [load_run(p) for p in run_dirs]
    if group_seeds:
        runs = group_by_seed(runs)
    else:
        differences = differing_keys({str(i): r.config for i, r in enumerate(runs)})
        runs = [with_differences(r, differences[str(i)]) for i, r in enumerate(runs)]
    out = Path(out)
    with new_files(out, REPORT, overwrite=overwrite) as tmp:
        (tmp / "compare.md").write_text(table(runs))
        plot(runs, tmp / "compare.png", smooth)
    return out / "compare.md", out / "compare.png"


def run_compare(runs: list[str], out: str, group_by_seed: bool, smooth: float, overwrite: bool) -> str:
    """``mega-suite compare``: training runs' curves, or mode=lm_eval folders' scores, side by side."""
    from mega_suite.storage.atomic import new_files

    if all((Path(r) / "lm_eval.json").is_file() for r in runs):  # mode=lm_eval folders: their scores
        from mega_suite.evaluation.harness import side_by_side

        text = side_by_side([Path(r) for r in runs])
        with new_files(Path(out), ["lm_eval_compare.md"], overwrite=overwrite) as tmp:
            (tmp / "lm_eval_compare.md").write_text(text)
        return f"{text}\nwrote {Path(out) / 'lm_eval_compare.md'}"
    md, png = compare(runs, out, group_by_seed, smooth, overwrite)
    return f"{md.read_text()}\nwrote {md} and {png}"


if __name__ == "__main__":  # the older name of `mega-suite compare`
    from mega_suite.cli import main

    sys.exit(main(["compare", *sys.argv[1:]], prog="python -m mega_suite.evaluation.compare"))
