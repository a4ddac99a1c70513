"""mode=lm_eval through EleutherAI's lm-evaluation-harness, on tiny local tasks of each kind, for both
architectures: accuracy against float64 log-likelihoods computed here, the rolling log-likelihood against
eval_context, generate-until against greedy generation cut at the stop string; the paper's task names in the
harness's index; one error line for an unknown task and for a hub task without its data."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from after_fixtures import tiny_bundle, tiny_model

from mega_suite.cli import main as cli

from datamodules.kjv import TOKENIZER
from mega_suite.evaluation.context import eval_context

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS = Path(__file__).resolve().parent / "tasks"
ROOT = Path(__file__).resolve().parents[2]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(TOKENIZER))


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    import run

    code = run.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module", params=["megalodon", "llama"])
def harness_run(request, tmp_path_factory):
    """One mode=lm_eval run of the three tiny tasks on a tiny bundle; (arch, run directory)."""
    import run

    arch = request.param
    folder = tmp_path_factory.mktemp(f"lm_eval_{arch}")
    bundle = tiny_bundle(arch, folder / "bundle")
    out = folder / "run"
    code = run.main([
        "recipe=kjv", "mode=lm_eval", f"ckpt={bundle}", f"run_dir={out}", f"lm_eval.include_path={TASKS}",
        "lm_eval.tasks=[tiny_mc,tiny_rolling,tiny_gen]", "trainer.accelerator=cpu",
    ])  # fmt: skip
    assert code == 0
    return arch, out


def samples(run_dir: Path, task: str) -> list[dict]:
    return sorted((s for s in read_jsonl(run_dir / "lm_eval_samples.jsonl") if s["task"] == task),
                  key=lambda s: s["doc_id"])  # fmt: skip


def float64_loglik(model, sp, context: str, continuation: str) -> float:
    """log p(continuation | BOS context) from a float64 full forward pass, log-softmax in float64; the
    continuation's tokens as the harness splits them (encode the whole, cut after the context's tokens)."""
    whole = sp.encode(context + continuation)
    n_context = len(sp.encode(context))
    tokens = torch.tensor([[sp.bos_id(), *whole]])
    with torch.no_grad():
        logits, _ = model(tokens)
    logp = torch.log_softmax(logits[0].double(), -1)
    return sum(float(logp[j - 1, tokens[0, j]]) for j in range(1 + n_context, tokens.shape[1]))


def test_multiple_choice_accuracy_is_the_argmax_of_float64_log_likelihoods(harness_run, sp):
    arch, run_dir = harness_run
    model = tiny_model(arch).double()  # the bundle's weights: same seed
    docs = read_jsonl(TASKS / "tiny_mc.jsonl")
    correct = []
    for doc, sample in zip(docs, samples(run_dir, "tiny_mc"), strict=True):
        oracle = [float64_loglik(model, sp, doc["question"], " " + c.lstrip()) for c in doc["choices"]]
        ranked = sorted(oracle)
        assert ranked[-1] - ranked[-2] > 1e-3, "a near tie would make the comparison meaningless"
        harness = [r[0][0] for r in sample["resps"]]
        assert harness == pytest.approx(oracle, abs=1e-4), (doc["question"], harness, oracle)
        correct.append(max(range(len(oracle)), key=oracle.__getitem__) == doc["answer"])
    result = json.loads((run_dir / "lm_eval.json").read_text())["results"]["tiny_mc"]
    assert result["acc,none"] == sum(correct) / len(correct)


def test_rolling_log_likelihood_is_eval_contexts_sum(harness_run, sp):
    arch, run_dir = harness_run
    model = tiny_model(arch)
    docs = read_jsonl(TASKS / "tiny_rolling.jsonl")
    total_nll, total_words = 0.0, 0
    for doc, sample in zip(docs, samples(run_dir, "tiny_rolling"), strict=True):
        tokens = torch.tensor([sp.bos_id(), *sp.encode(doc["text"])])
        if arch == "llama":
            assert tokens.numel() > 64 or doc is not docs[0], "the first document must exceed Llama's window"
        row = eval_context(model, [tokens], [tokens.numel() - 1], progress=False)[0]
        assert row["tokens"] == tokens.numel() - 1
        assert -sample["resps"][0][0] == pytest.approx(row["nll"], rel=1e-9)
        total_nll += row["nll"]
        total_words += len(re.split(r"\s+", doc["text"]))
    result = json.loads((run_dir / "lm_eval.json").read_text())["results"]["tiny_rolling"]
    assert result["word_perplexity,none"] == pytest.approx(math.exp(total_nll / total_words), rel=1e-9)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(harness_run, sp):
    from mega_suite.models.llama.decode import generate as llama_generate
    from mega_suite.models.megalodon.decode import generate as megalodon_generate

    arch, run_dir = harness_run
    model = tiny_model(arch)
    library = megalodon_generate if arch == "megalodon" else llama_generate
    cut_somewhere = False
    for doc, sample in zip(read_jsonl(TASKS / "tiny_gen.jsonl"), samples(run_dir, "tiny_gen"), strict=True):
        prompt = torch.tensor([[sp.bos_id(), *sp.encode(doc["prompt"])]])
        out = library(model, prompt, 12, greedy=True, eos_id=sp.eos_id())
        text = sp.decode(out[0, prompt.shape[1] :].tolist())
        cuts = [text.index(s) for s in (".", "as") if s in text]
        assert sample["resps"][0][0] == text[: min(cuts, default=len(text))]
        cut_somewhere |= bool(cuts)
    assert cut_somewhere, "no generation reached a stop string: the cut went untested"


def test_the_report_says_how_much_context_the_model_saw(harness_run):
    arch, run_dir = harness_run
    table = (run_dir / "lm_eval.md").read_text()
    assert "| tiny_mc | acc |" in table and "| tiny_rolling | word_perplexity |" in table
    if arch == "llama":
        assert "window: at most 64 tokens" in table
    else:
        assert "full context" in table
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_compare_puts_two_lm_eval_runs_side_by_side(tmp_path, tmp_path_factory):
    from mega_suite.evaluation import compare

    runs = []
    for arch in ("megalodon", "llama"):
        run_dir = tmp_path / arch
        run_dir.mkdir()
        record = {"arch": arch, "context": f"{arch} note", "checkpoint": "x",
                  "results": {"tiny_mc": {"acc,none": 0.25 if arch == "llama" else 0.75, "acc_stderr,none": 0.1}}}  # fmt: skip
        (run_dir / "lm_eval.json").write_text(json.dumps(record))
        runs.append(str(run_dir))
    assert cli(["compare", *runs, "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "lm_eval_compare.md").read_text()
    assert re.search(r"\| tiny_mc/acc \| 0\.7500 \| 0\.2500 \|", text)


def test_paper_task_names_resolve_and_a_hub_task_without_data_is_one_error(capsys, tmp_path):
    from mega_suite.config import ConfigError
    from mega_suite.evaluation.harness import PAPER_TASKS, load_tasks, task_manager

    names = [n for v in PAPER_TASKS.values() for n in ([v] if isinstance(v, str) else v)]
    manager = task_manager(names, None)  # raises on any name the harness does not know
    assert set(names) <= set(manager.all_tasks)
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['hellaswagg'\].*'hellaswag'"):
        task_manager(["hellaswagg"], None)
    with pytest.raises(ConfigError, match=r"lm_eval task 'boolq' cannot read its data offline"):
        load_tasks(manager, ["boolq"])
    bundle = tiny_bundle("megalodon", tmp_path / "bundle")
    for task, expected in (("hellaswagg", "unknown task"), ("boolq", "cannot read its data offline")):
        code, _, err = run_cli(["recipe=kjv", "mode=lm_eval", f"ckpt={bundle}", f"run_root={tmp_path}",
                                f"lm_eval.tasks=[{task}]"], capsys)  # fmt: skip
        lines = err.strip().splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
