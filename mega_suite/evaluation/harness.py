"""``mode=lm_eval``: any suite language model scored by EleutherAI's lm-evaluation-harness
(docs/after_training.md#lm_eval).

``SuiteLM`` (registered with the harness as ``mega_suite``) is a ``TemplateLM`` over a model and its
tokenizer:

- ``loglikelihood``: the continuation's log-probability from the model's own log-softmax on the hidden
  states of its streaming pass, fed one ``eval_segment`` at a time (memory bounded by a chunk);
- ``loglikelihood_rolling``: a whole document's, from the same streaming pass (``score_window``'s, the
  evaluation ``eval_context`` runs, ``evaluation/context.py``);
- ``generate_until``: ``models.generation.generate`` (greedy unless the task samples), stopped at the first
  stop string or EOS, cut there.

The two log-likelihood kinds run ``batch_size`` requests per pass (``lm_eval.batch_size``): sorted longest
first and grouped by the harness's ``Collator`` (as its HFLM does; requests sharing context and all but the
last continuation token are scored once), right-padded, and answered in the requests' order. Both models
are causal, so a row's padding cannot reach its own positions: a batch gives one-at-a-time's numbers (to
float rounding). ``generate_until`` stays one request at a time (see ``generate_until``).

Megalodon streams its exact recurrent state, so it is scored with its full context. Llama sees its window:
its streaming pass is the sliding window, and a generation prompt longer than the window keeps its last
``max_seq_len`` tokens; the report says so.

The harness runs offline (``HF_DATASETS_OFFLINE``, ``HF_HUB_OFFLINE``): a task reads local data
(``dataset_path: json`` with ``data_files``, relative paths resolved against its YAML's folder) or the
Hugging Face cache; a task whose data is in neither fails with one error naming it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported (it reads them once)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from mega_suite.config import ConfigError  # noqa: E402
from mega_suite.config.lm_eval_tasks import check_task_names, manager  # noqa: E402
from mega_suite.models import arch_of  # noqa: E402
from mega_suite.models.generation import generate  # noqa: E402

# The paper's downstream tasks (its Table 1 and long-context table) by the harness's names.
PAPER_TASKS = {
    "mmlu": "mmlu",
    "boolq": "boolq",
    "hellaswag": "hellaswag",
    "piqa": "piqa",
    "siqa": "social_iqa",
    "winogrande": "winogrande",
    "arc_e": "arc_easy",
    "arc_c": "arc_challenge",
    "nq": "nq_open",
    "tqa": "triviaqa",
    "scrolls_qa": ["scrolls_narrativeqa", "scrolls_qasper", "scrolls_quality"],
}
_LOCAL_DATASETS = ("json", "csv", "text", "parquet")


@register_model("mega_suite")
class SuiteLM(TemplateLM):
    """A suite language model and its tokenizer (``TextTokenizer``) as the harness sees them."""

    def __init__(self, model, tokenizer, max_gen_toks: int = 256, batch_size: int = 16):
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"lm_eval.batch_size={batch_size!r} is invalid: expected an integer >= 1")
        self.model = model.eval()
        self.batch_size = batch_size
        self.tok = tokenizer
        self.max_gen_toks = max_gen_toks
        self.arch = arch_of(model.cfg).name
        self.window = getattr(model.cfg, "max_seq_len", None)  # Llama
        self._device = next(model.parameters()).device

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # documents were trained as BOS tokens EOS

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, bos=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    def _with_bos(self, tokens: list[int]) -> list[int]:
        return tokens if tokens and tokens[0] == self.tok.bos_id else [self.tok.bos_id, *tokens]

    # ------------------------------------------------------------------ scoring
    def _stream(self, rows: list[list[int]]):
        """Stream ``rows`` (token lists, right-padded into one batch) through the model one
        ``eval_segment`` at a time with its cache; yield (start, hidden [B, s, D]) per segment. Both models
        are causal, so the padding after a row's last token leaves its earlier positions unchanged."""
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.tok.eos_id, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        tokens = tokens.to(self._device)
        segment, cache = self.model.eval_segment(), None
        for start in range(0, width, segment):
            hidden, cache = self.model.forward_hidden(
                tokens[:, start : start + segment], cache, use_cache=True
            )
            yield start, hidden

    @torch.no_grad()
    def _score_batch(self, batch: list) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """For each (strings, context, continuation) of ``batch``: the log-probability [n] of each
        continuation token given BOS, the context and the tokens before it, whether each is the argmax [n],
        and the whole log-softmax row [V] of the last position (for a grouped request that differs in its
        last token only)."""
        seqs = [self._with_bos(context) + list(continuation) for _, context, continuation in batch]
        inputs = [seq[:-1] for seq in seqs]
        # Flat (row, input position, target) of every continuation token of the batch.
        rows = torch.tensor([i for i, (_, _, c) in enumerate(batch) for _ in c], device=self._device)
        pos = torch.tensor(
            [p for seq, (_, _, c) in zip(seqs, batch) for p in range(len(seq) - 1 - len(c), len(seq) - 1)],
            device=self._device,
        )
        targets = torch.tensor([t for _, _, c in batch for t in c], device=self._device)
        logp = torch.empty(targets.shape, dtype=torch.float64, device=self._device)
        greedy = torch.empty(targets.shape, dtype=torch.bool, device=self._device)
        last: list[torch.Tensor | None] = [None] * len(batch)
        ends = torch.tensor([len(x) - 1 for x in inputs], device=self._device)
        for start, hidden in self._stream(inputs):
            here = ((pos >= start) & (pos < start + hidden.shape[1])).nonzero().squeeze(1)
            if here.numel() == 0:
                continue
            table = torch.log_softmax(self.model.logits(hidden[rows[here], pos[here] - start]), -1)
            logp[here] = table.gather(-1, targets[here, None]).squeeze(-1).double()
            greedy[here] = table.argmax(-1) == targets[here]
            for k in (pos[here] == ends[rows[here]]).nonzero().squeeze(1).tolist():
                last[int(rows[here[k]])] = table[k]
        out, at = [], 0
        for i, (_, _, c) in enumerate(batch):
            out.append((logp[at : at + len(c)], greedy[at : at + len(c)], last[i]))
            at += len(c)
        return out

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Batches of ``batch_size`` requests, longest first, through ``_score_batch``; requests that share
        context + continuation[:-1] (the choices of a one-token multiple choice) are scored once (the
        harness's ``Collator``, as HFLM groups them); results in the requests' order."""
        from lm_eval.models.utils import Collator

        collator = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[1] + r[2][:-1],
        )
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for batch in collator.get_batched(n=self.batch_size):
            for (strings, context, continuation), (logp, greedy, last) in zip(
                batch, self._score_batch(batch)
            ):
                # get_cache yields every request of the group; its logits argument is unused here (the
                # scores above are per token, not [n, V])
                for strings_i, cont, _ in collator.get_cache(
                    req_str=strings, cxt_toks=context, cont_toks=continuation, logits=torch.empty(1, 0, 0)
                ):
                    n = len(cont)
                    answer = (
                        (0.0, True)
                        if n == 0
                        else (  # an empty continuation: log 1
                            float(logp[len(logp) - n : -1].sum() + last[cont[-1]].double()),
                            bool(greedy[len(greedy) - n : -1].all()) and int(last.argmax()) == cont[-1],
                        )
                    )
                    out.append(answer)
                    if strings_i is not None:
                        self.cache_hook.add_partial("loglikelihood", strings_i, answer)
                    bar.update(1)
        bar.close()
        return collator.get_original(out)

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-likelihood from a streaming pass over all of it (``score_window``'s,
        as ``eval_context`` scores it), ``batch_size`` documents at a time, longest first."""
        from lm_eval.models.utils import Collator

        docs = [self.tok.encode(request.args[0], bos=True) for request in requests]
        collator = Collator(list(enumerate(docs)), sort_fn=lambda d: (-len(d[1]), d[0]))
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood_rolling")
        for batch in collator.get_batched(n=self.batch_size):
            nll = torch.zeros(len(batch), dtype=torch.float64, device=self._device)
            width = max(len(doc) for _, doc in batch) - 1
            targets = torch.full((len(batch), max(width, 0)), -100, dtype=torch.long, device=self._device)
            for i, (_, doc) in enumerate(batch):
                targets[i, : len(doc) - 1] = torch.tensor(doc[1:], dtype=torch.long)
            if width > 0:
                for start, hidden in self._stream([doc[:-1] for _, doc in batch]):
                    y = targets[:, start : start + hidden.shape[1]]
                    nll += self.model.token_nll(hidden, y).double().sum(1)
            for (index, _), value in zip(batch, nll.tolist()):
                out.append(-value)
                self.cache_hook.add_partial("loglikelihood_rolling", requests[index].args, out[-1])
                bar.update(1)
        bar.close()
        return collator.get_original(out)

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One request at a time: prompts of different lengths in one batch would need left padding or
        per-row positions, and the decoders have neither (a left pad would enter Megalodon's CEMA and
        TimestepNorm states as a timestep; Llama's cache has one position for all rows)."""
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, kwargs = request.args
            out.append(self.continue_text(context, dict(kwargs)))
            self.cache_hook.add_partial("generate_until", request.args, out[-1])
        return out

    def continue_text(self, context: str, kwargs: dict) -> str:
        """The greedy (or sampled, with ``do_sample``) continuation of ``context`` cut at the first stop
        string of ``until``."""
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sample = bool(kwargs.pop("do_sample", False)) and temperature > 0
        ids = self.tok.encode(context, bos=True)
        if self.window is not None and len(ids) > self.window:
            ids = ids[-self.window :]  # what Llama sees
        prompt = torch.tensor([ids], device=self._device)

        def stop(seq: torch.Tensor) -> bool:
            text = self.tok.decode(seq[0, len(ids) :].tolist())
            return any(s and s in text for s in until)

        seq = generate(
            self.model, prompt, max_new, temperature=temperature if sample else 1.0,
            top_k=kwargs.pop("top_k", None), top_p=kwargs.pop("top_p", None), greedy=not sample,
            eos_id=self.tok.eos_id, stop=stop if until else None,
        )  # fmt: skip
        return cut_at_stop(self.tok.decode(seq[0, len(ids) :].tolist()), until)

    def get_model_info(self) -> dict:
        return {"model_arch": self.arch, "window": self.window}


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string."""
    cut = len(text)
    for s in until:
        if s and s in text:
            cut = min(cut, text.index(s))
    return text[:cut]


# --------------------------------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------------------------------


def task_manager(names: list[str], include_path: str | None):
    """A TaskManager that knows ``names``: the local folder alone when it has them all (fast), else with the
    harness's own index; an unknown name or a missing folder is a ConfigError (``check_task_names``)."""
    check_task_names(names, include_path)
    include_path = str(Path(include_path).resolve()) if include_path else None
    if include_path:
        local = manager(include_path, False)
        if all(n in local.all_tasks for n in names):
            return local
    return manager(include_path, True)


def task_spec(manager, name: str) -> str | dict:
    """A task name, or, for a YAML task reading local files (``dataset_path: json`` ...), its config with
    relative ``data_files`` resolved against the YAML's folder (``data_dir``)."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(name)
    if entry is None or entry.kind != Kind.TASK or entry.yaml_path is None:
        return name
    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    if cfg.get("dataset_path") not in _LOCAL_DATASETS:
        return name
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    kwargs.setdefault("data_dir", str(Path(entry.yaml_path).parent))
    return {**cfg, "dataset_kwargs": kwargs}


def load_tasks(manager, names: list[str]) -> list:
    """Build each task (which reads its data) once here, so that a task without its data is one error."""
    specs = []
    for name in names:
        spec = task_spec(manager, name)
        try:
            manager.load([spec])
        except (ConnectionError, OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, FileNotFoundError) and not _is_hub_error(exc):
                raise FileNotFoundError(f"lm_eval task {name!r}: {exc}") from None
            raise ConfigError(
                f"lm_eval task {name!r} cannot read its data offline ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}): the harness never downloads here "
                "(HF_DATASETS_OFFLINE=1). Put the data set in the Hugging Face cache (HF_DATASETS_CACHE) from a "
                "machine with network, or give a local task YAML with JSON data_files in lm_eval.include_path"
            ) from None
        specs.append(spec)
    return specs


def _is_hub_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(w in text for w in ("offline", "hub", "connection", "couldn't find", "huggingface"))


# --------------------------------------------------------------------------------------------------------------
# the mode
# --------------------------------------------------------------------------------------------------------------


def evaluate(lm: SuiteLM, cfg: DictConfig, manager, specs: list) -> dict:
    from lm_eval import simple_evaluate

    e = cfg.lm_eval
    limit = None if e.limit is None else (int(e.limit) if e.limit >= 1 else float(e.limit))
    seed = int(cfg.seed)
    return simple_evaluate(
        model=lm, tasks=specs, num_fewshot=e.num_fewshot, limit=limit, task_manager=manager,
        batch_size=lm.batch_size,  # recorded in the results' config
        log_samples=True, bootstrap_iters=1000, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed,
    )  # fmt: skip


def scalars(results: dict) -> dict[str, float]:
    """{"task/metric": value} of the numeric metrics (stderr apart)."""
    out = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                if "," not in key or "_stderr" in key or not isinstance(value, int | float):
                    continue
                metric, filt = key.split(",", 1)
                name = f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")
                if isinstance(value, float) and math.isnan(value):
                    continue
                out[name] = float(value)
    return out


def _json(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: repr(o)))


def run_lm_eval(cfg: DictConfig, loaders: list[Callable[[], Any]], run_dir: Path) -> dict[str, float]:
    """Score each trained model (``loaders``: one per checkpoint) on ``lm_eval.tasks``; write
    ``lm_eval.json`` / ``lm_eval.md`` (several checkpoints: ``lm_eval_curve.md`` / ``.png``, score against
    training tokens) and TensorBoard scalars into ``run_dir``."""
    from torch.utils.tensorboard import SummaryWriter

    names = list(cfg.lm_eval.tasks)
    manager = task_manager(names, cfg.lm_eval.include_path)
    specs = load_tasks(manager, names)
    writer = SummaryWriter(str(run_dir))
    rows, records = [], []
    for index, load in enumerate(loaders):
        trained = load()
        lm = SuiteLM(
            trained.model, trained.tokenizer, max_gen_toks=int(cfg.lm_eval.max_gen_toks),
            batch_size=int(cfg.lm_eval.batch_size),
        )  # fmt: skip
        note = f"Model: {trained.context_note()}. Checkpoint: {trained.source}" + (
            f" (step {trained.step}" + (f", {trained.tokens} training tokens)" if trained.tokens else ")")
            if trained.step is not None
            else ""
        )
        print(f"[mega-suite] lm_eval: {note}")
        results = evaluate(lm, cfg, manager, specs)
        values = scalars(results)
        x = (
            trained.tokens
            if trained.tokens is not None
            else (trained.step if trained.step is not None else index)
        )
        for name, value in values.items():
            writer.add_scalar(f"lm_eval/{name}", value, x)
        record = {
            "checkpoint": str(trained.source), "step": trained.step, "tokens": trained.tokens,
            "arch": trained.arch, "context": trained.context_note(), "results": results.get("results"),
            "groups": results.get("groups"), "n-shot": results.get("n-shot"), "n-samples": results.get("n-samples"),
            "versions": results.get("versions"), "config": results.get("config"),
        }  # fmt: skip
        records.append(_json(record))
        rows.append((trained, values))
        md = table_from_record(records[-1])
        writer.add_text("lm_eval", md, x)
        print(md)
        samples = results.get("samples") or {}
        with open(
            run_dir / ("lm_eval_samples.jsonl" if index == 0 else f"lm_eval_samples.{index}.jsonl"), "w"
        ) as f:
            for task, items in samples.items():
                for item in items:
                    f.write(json.dumps(_json({"task": task, **item})) + "\n")
    writer.close()
    (run_dir / "lm_eval.json").write_text(
        json.dumps(records[0] if len(records) == 1 else records, indent=1) + "\n"
    )
    (run_dir / "lm_eval.md").write_text("\n\n".join(table_from_record(r) for r in records) + "\n")
    if len(rows) > 1:
        write_curve(rows, run_dir)
    print(f"[mega-suite] wrote {run_dir / 'lm_eval.json'} and the table")
    return rows[-1][1]


def table_from_record(record: dict) -> str:
    lines = [f"Model: {record['context']}. Checkpoint: {record['checkpoint']}", ""]
    lines += ["| task | metric | value | stderr | n-shot | n |", "|---|---|---:|---:|---:|---:|"]
    for section in ("results", "groups"):
        for task, metrics in sorted((record.get(section) or {}).items()):
            shots = (record.get("n-shot") or {}).get(task, "")
            n = ((record.get("n-samples") or {}).get(task) or {}).get("effective", "")
            for key, value in metrics.items():
                if "," not in key or "_stderr" in key or not isinstance(value, int | float):
                    continue
                metric, filt = key.split(",", 1)
                err = metrics.get(f"{metric}_stderr,{filt}")
                err = f"{err:.4f}" if isinstance(err, int | float) else "-"
                label = metric if filt == "none" else f"{metric} ({filt})"
                lines.append(f"| {task} | {label} | {value:.4f} | {err} | {shots} | {n} |")
    return "\n".join(lines)


def write_curve(rows: list, run_dir: Path) -> None:
    """Score against training tokens over several checkpoints: ``lm_eval_curve.md`` and ``.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({n for _, values in rows for n in values})
    lines = [
        "| checkpoint | step | tokens | " + " | ".join(names) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for trained, values in rows:
        cells = [f"{values[n]:.4f}" if n in values else "-" for n in names]
        lines.append(
            f"| {Path(trained.source).name} | {trained.step if trained.step is not None else '-'} | "
            f"{trained.tokens if trained.tokens is not None else '-'} | " + " | ".join(cells) + " |"
        )
    (run_dir / "lm_eval_curve.md").write_text(rows[0][0].context_note() + "\n\n" + "\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    use_tokens = all(t.tokens is not None for t, _ in rows)
    xs = [t.tokens if use_tokens else (t.step if t.step is not None else i) for i, (t, _) in enumerate(rows)]
    for name in names:
        ax.plot(xs, [v.get(name, float("nan")) for _, v in rows], marker="o", label=name)
    ax.set_xlabel("training tokens" if use_tokens else "step")
    ax.set_ylabel("score")
    ax.set_title("lm-evaluation-harness score against training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "lm_eval_curve.png", dpi=120)
    plt.close(fig)


def side_by_side(paths: list[Path]) -> str:
    """The ``lm_eval.json`` of several runs as one Markdown table, a column per run
    (``python -m mega_suite.evaluation.compare``)."""
    records = []
    for path in paths:
        file = Path(path) / "lm_eval.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no lm_eval.json (a mode=lm_eval run directory was expected)")
        record = json.loads(file.read_text())
        records.append(record[-1] if isinstance(record, list) else record)
    values = [scalars(r) for r in records]
    names = sorted({n for v in values for n in v})
    lines = [
        "| task / metric | "
        + " | ".join(f"{Path(p).name} ({r['arch']})" for p, r in zip(paths, records))
        + " |"
    ]
    lines.append("|---|" + "---:|" * len(records))
    for name in names:
        lines.append(
            f"| {name} | " + " | ".join(f"{v[name]:.4f}" if name in v else "-" for v in values) + " |"
        )
    notes = [
        f"- {Path(p).name}: {r['context']}; checkpoint {r['checkpoint']}" for p, r in zip(paths, records)
    ]
    return "\n".join(lines + [""] + notes) + "\n"
