"""mode=lm_eval through EleutherAI's lm-evaluation-harness, on tiny local tasks of each kind, for both
architectures: accuracy against float64 log-likelihoods computed here, the rolling log-likelihood against
eval_context, generate-until against greedy generation cut at the stop string; the paper's task names in the
harness's index; one error line for an unknown task and for a hub task without its data.

The batched adapter (``SuiteLM``, ``lm_eval.batch_size``): right padding leaves every row's hidden states
unchanged (both models streamed in eval_segment pieces); batched log-likelihoods and is_greedy against a
float64 oracle of full passes (Llama's sliding window written out per position) and against one request at a
time, in the requests' order, with contexts crossing eval_segment and Llama's window; rolling
log-likelihoods against score_window one document at a time."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch
from after_fixtures import tiny_bundle, tiny_model

from datamodules.kjv import TOKENIZER
from mega_suite.cli import main as cli
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
        "lm_eval.tasks=[tiny_mc,tiny_rolling,tiny_gen]", "trainer.accelerator=cpu", "lm_eval.batch_size=3",
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
        # batch 3 against eval_context's one document at a time: float32 rounding of a different batch shape
        assert -sample["resps"][0][0] == pytest.approx(row["nll"], rel=1e-6)
        total_nll += row["nll"]
        total_words += len(re.split(r"\s+", doc["text"]))
    record = json.loads((run_dir / "lm_eval.json").read_text())
    assert record["config"]["batch_size"] == 3, "lm_eval.batch_size did not reach the adapter"
    result = record["results"]["tiny_rolling"]
    assert result["word_perplexity,none"] == pytest.approx(math.exp(total_nll / total_words), rel=1e-6)


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
        assert "window of 64 tokens" in table
    else:
        assert "full context" in table
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_compare_puts_two_lm_eval_runs_side_by_side(tmp_path, tmp_path_factory):

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


# --------------------------------------------------------------------------------------------------------------
# the batched adapter, model-level
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_tokenizer():
    from datamodules.tokenizer import TextTokenizer

    return TextTokenizer(TOKENIZER)


@pytest.fixture(scope="module", params=["megalodon", "llama"])
def arch_models(request):
    """(arch, float32 tiny model, its float64 copy)."""
    model = tiny_model(request.param)
    return request.param, model, tiny_model(request.param).double()


def oracle_logprobs(model, arch: str, tokens: list[int], positions: range) -> torch.Tensor:
    """[len(positions), V] float64 log-softmax of the prediction after tokens[: p + 1] for each p, from full
    passes without a cache: Megalodon's over the whole prefix; Llama's over the sliding window (the position's
    block of ``stride`` tokens starts at a multiple of the stride and sees the ``max_seq_len - stride``
    tokens before it: tokens[lo : p + 1] with lo = max(0, p // stride * stride - (max_seq_len - stride)))."""
    x = torch.tensor([tokens])
    with torch.no_grad():
        if arch == "megalodon":
            logits = model(x[:, : positions.stop])[0][0, positions.start :]
        else:
            window, stride = model.cfg.max_seq_len, model.cfg.stride
            los = [max(0, p // stride * stride - (window - stride)) for p in positions]
            logits = torch.stack([model(x[:, lo : p + 1])[0][0, -1] for lo, p in zip(los, positions)])
    return torch.log_softmax(logits.double(), -1)


def oracle_answer(
    model, arch: str, context: list[int], continuation: list[int], bos: int
) -> tuple[float, bool]:
    if not continuation:
        return 0.0, True
    tokens = [bos, *context, *continuation] if context[0] != bos else [*context, *continuation]
    first = len(tokens) - 1 - len(continuation)
    logp = oracle_logprobs(model, arch, tokens, range(first, len(tokens) - 1))
    target = torch.tensor(continuation)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def greedy_tokens(model, arch: str, context: list[int], n: int) -> list[int]:
    tokens = list(context)
    for _ in range(n):
        tokens.append(
            int(oracle_logprobs(model, arch, tokens, range(len(tokens) - 1, len(tokens)))[0].argmax())
        )
    return tokens[len(context) :]


def mixed_requests(model, arch: str, bos: int) -> list[tuple]:
    """_loglikelihood_tokens requests in shuffled order: contexts of 1 to 150 tokens (Megalodon's chunk is 16,
    Llama's stride 32 and window 64), continuations of 1 to 20; a group of one-token continuations of one
    context, and one sharing context + continuation[:-1] with a longer continuation (the harness's Collator
    scores each group once); greedy continuations (is_greedy True) and the same with one token changed in the
    middle or at the end (False)."""
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(4, 4096) for _ in range(n)]  # noqa: E731
    requests = []
    for n, m in [(1, 1), (3, 2), (15, 1), (16, 5), (17, 20), (31, 2), (33, 3), (63, 1), (64, 2), (65, 7),
                 (100, 4), (150, 20), (2, 35)]:  # fmt: skip
        requests.append((("c", "x"), [bos, *draw(n - 1)] if n % 2 else draw(n), draw(m)))
    shared = draw(40)
    for token in draw(3):
        requests.append((("s", "x"), shared, [token]))
    extra = draw(1)
    requests.append((("s", "y"), shared + extra, draw(1)))
    requests.append((("s", "z"), shared, [extra[0], *draw(1)]))
    requests.append((("s", ""), shared + extra, []))  # an empty continuation: log 1, greedy
    for n in (5, 20, 70, 120):  # greedy: within a segment, across segments, beyond Llama's window
        context = draw(n)
        greedy = greedy_tokens(model, arch, [bos, *context], 4)
        requests.append((("g", "x"), context, greedy))
        requests.append((("g", "y"), context, greedy[:1]))
        for at in (1, 3):
            changed = list(greedy)
            changed[at] = (changed[at] + 1) % 4096
            requests.append((("g", "z"), context, changed))
    rng.shuffle(requests)
    return requests


@pytest.fixture(scope="module")
def batched_answers(arch_models, text_tokenizer):
    """The requests, the float64 oracle's answers, and the adapter's: float64 at batch 1 and 5, float32 at
    batch 1 and 64."""
    from mega_suite.evaluation.harness import SuiteLM

    arch, model32, model64 = arch_models
    requests = mixed_requests(model64, arch, text_tokenizer.bos_id)
    oracle = [oracle_answer(model64, arch, c, x, text_tokenizer.bos_id) for _, c, x in requests]
    answers = {
        (dtype, b): SuiteLM(m, text_tokenizer, batch_size=b)._loglikelihood_tokens(
            requests, disable_tqdm=True
        )
        for dtype, m in (("float64", model64), ("float32", model32))
        for b in ((1, 5) if dtype == "float64" else (1, 64))
    }
    return requests, oracle, answers


def test_right_padding_leaves_every_rows_hidden_states_unchanged(arch_models):
    """Rows of 5 to 150 tokens right-padded with random tokens, streamed in eval_segment pieces with the
    cache (Megalodon: CEMA, TimestepNorm and chunked attention across chunks of 16; Llama: the sliding window
    beyond 64): each row's positions equal the row streamed alone, whatever the padding."""
    arch, _, model = arch_models
    rng = torch.Generator().manual_seed(0)
    lengths = [150, 5, 17, 40, 70, 130]
    rows = [torch.randint(4, 4096, (n,), generator=rng) for n in lengths]

    def stream(tokens: torch.Tensor) -> torch.Tensor:
        cache, out = None, []
        with torch.no_grad():
            for start in range(0, tokens.shape[1], model.eval_segment()):
                h, cache = model.forward_hidden(tokens[:, start : start + model.eval_segment()], cache, True)
                out.append(h)
        return torch.cat(out, 1)

    alone = [stream(r[None])[0] for r in rows]
    for _ in range(2):
        batch = torch.randint(4, 4096, (len(rows), max(lengths)), generator=rng)
        for i, r in enumerate(rows):
            batch[i, : r.numel()] = r
        hidden = stream(batch)
        for i, r in enumerate(rows):
            torch.testing.assert_close(hidden[i, : r.numel()], alone[i], rtol=1e-10, atol=1e-10)


def test_batched_loglikelihood_is_a_float64_oracles_in_the_requests_order(batched_answers):
    requests, oracle, answers = batched_answers
    flags = [g for _, g in oracle]
    assert any(flags) and not all(flags), "is_greedy needs both values among the requests to be tested"
    for key in (("float64", 1), ("float64", 5)):
        got = answers[key]
        assert len(got) == len(requests)
        for request, (lp, greedy), (want_lp, want_greedy) in zip(requests, got, oracle, strict=True):
            assert abs(lp - want_lp) < 1e-6, (key, request, lp, want_lp)
            assert greedy == want_greedy, (key, request)


def test_batched_loglikelihood_equals_one_request_at_a_time(batched_answers):
    """The same is_greedy, and log-probabilities within 1e-6: absolute in float64 (a batch's other shapes
    round differently by ~1e-13 there), relative in float32 (a few float32 ulps of the sum: one token's
    log-probability of 8.95 differs by one ulp, 9.5e-7)."""
    _, _, answers = batched_answers
    for dtype, batch in (("float64", 5), ("float32", 64)):
        one, many = answers[(dtype, 1)], answers[(dtype, batch)]
        for (a, ga), (b, gb) in zip(one, many, strict=True):
            scale = 1.0 if dtype == "float64" else max(1.0, abs(a))
            assert abs(a - b) <= 1e-6 * scale, (dtype, a, b)
            assert ga == gb, (dtype, a, b)


def test_the_progress_bar_counts_requests(arch_models, text_tokenizer, capsys):
    from mega_suite.evaluation.harness import SuiteLM

    _, model, _ = arch_models
    shared = [5, 6, 7]
    requests = [(None, shared, [t]) for t in (8, 9, 10)] + [(None, [5, 6], [7, 8])]  # one group of four
    SuiteLM(model, text_tokenizer, batch_size=2)._loglikelihood_tokens(requests)
    err = capsys.readouterr().err
    assert "loglikelihood" in err and "4/4" in err, err


def test_batched_rolling_log_likelihood_is_score_window_one_document_at_a_time(arch_models, text_tokenizer):
    """Documents of 2 to ~190 tokens (across chunks and Llama's window) in no length order, batch 3: each
    answer is score_window's NLL of that document alone (float64 model)."""
    from mega_suite.evaluation.context import score_window
    from mega_suite.evaluation.harness import SuiteLM

    _, _, model = arch_models
    texts = [json.loads(line)["text"] for line in (TASKS / "tiny_rolling.jsonl").read_text().splitlines()]
    texts = [texts[1], "Amen.", texts[0], " ".join(texts), "Jesus wept.", texts[0][:60]]
    requests = [SimpleNamespace(args=(t,)) for t in texts]
    got = SuiteLM(model, text_tokenizer, batch_size=3).loglikelihood_rolling(requests, disable_tqdm=True)
    for text, value in zip(texts, got, strict=True):
        tokens = torch.tensor(text_tokenizer.encode(text, bos=True))
        nll, _ = score_window(model, tokens, model.eval_segment())
        assert -value == pytest.approx(nll, abs=1e-6), text


def test_batch_size_is_a_positive_integer(text_tokenizer):
    from mega_suite.config import ConfigError
    from mega_suite.config.recipes import load_config
    from mega_suite.evaluation.harness import SuiteLM

    assert (
        load_config(
            ["recipe=kjv", "mode=lm_eval", "ckpt=run", "lm_eval.tasks=[a]", "lm_eval.batch_size=7"]
        ).lm_eval.batch_size
        == 7
    )
    with pytest.raises(ConfigError, match="lm_eval.batch_size"):
        load_config(["recipe=kjv", "mode=lm_eval", "ckpt=run", "lm_eval.tasks=[a]", "lm_eval.batch_size=0"])
    with pytest.raises(ValueError, match="lm_eval.batch_size=0"):
        SuiteLM(tiny_model("llama"), text_tokenizer, batch_size=0)
