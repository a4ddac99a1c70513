"""Language-model evaluation: word-level perplexity normalisation, streaming evaluation, eval_context."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from modality_fixtures import write_pg19

from mega_suite.evaluation.context import documents_from_segments, eval_context, write_report
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.training.module import CausalLM
from mega_suite.training.runner import ValWithTest

CFG = dict(
    num_layers=2, model_dim=16, num_heads=1, z_dim=8, value_dim=16, ffn_hidden_dim=16, cema_ndim=4,
    norm_num_groups=4, chunk_size=8, swiglu=True,
)  # fmt: skip
OPTIM = dict(lr=1e-3, weight_decay=0.0, betas=[0.9, 0.98], eps=1e-8, schedule="constant", warmup_steps=0,
             min_lr_ratio=0.0, clip_grad_norm=1.0, no_decay_groups=False)  # fmt: skip


@pytest.fixture(scope="module")
def pg19_dm(tmp_path_factory):
    from datamodules.pg19 import PG19DataModule

    root = tmp_path_factory.mktemp("pg19eval")
    texts = write_pg19(root)
    dm = PG19DataModule(str(root), batch_size=2, seq_len=32, eval_seq_len=24, vocab_size=320)
    dm.prepare_data()
    dm.setup("validate")
    return dm, texts


def _module(vocab: int) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(MegalodonConfig(vocab_size=vocab, **CFG), optim=OPTIM, trainer={}, total_steps=1)


def _validate(module, dm) -> dict[str, float]:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    out = trainer.validate(module, datamodule=ValWithTest(dm), verbose=False)
    return {k: float(v) for d in out for k, v in d.items()}


def test_word_perplexity_is_total_nll_over_words(pg19_dm):
    """A model that spreads probability uniformly: NLL = log V per token, word ppl = exp(T log V / W)."""
    dm, texts = pg19_dm
    vocab = dm.vocab_size
    module = _module(vocab)
    module.model.token_nll = lambda hidden, target: (target != -100).to(torch.float32) * math.log(vocab)
    metrics = _validate(module, dm)
    for stage, split in (("val", "validation"), ("test", "test")):
        words = sum(len(t.split()) for t in texts[split].values())
        assert dm.num_words[stage] == words
        tokens = sum(len(dm.tokenizer.encode(t)) + 1 for t in texts[split].values())  # each token, then EOS
        assert metrics[f"{stage}/word_ppl"] == pytest.approx(
            math.exp(tokens * math.log(vocab) / words), rel=1e-6
        )
        assert metrics[f"{stage}/ppl"] == pytest.approx(vocab, rel=1e-6)


def test_streaming_evaluation_equals_full_pass_per_book(pg19_dm):
    dm, _ = pg19_dm
    module = _module(dm.vocab_size).eval()
    metrics = _validate(module, dm)
    nll, count = 0.0, 0
    with torch.no_grad():
        for doc in documents_from_segments(dm.val_dataloader()):
            hidden, _ = module.model.forward_hidden(doc[None, :-1])
            nll += float(module.model.token_nll(hidden, doc[None, 1:]).sum())
            count += doc.numel() - 1
    assert metrics["val/loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["val/word_ppl"] == pytest.approx(math.exp(nll / dm.num_words["val"]), rel=1e-5)


def test_eval_context_scores_every_token_once_and_reports(pg19_dm, tmp_path):
    dm, _ = pg19_dm
    module = _module(dm.vocab_size).eval()
    docs = list(documents_from_segments(dm.val_dataloader()))
    longest = max(d.numel() for d in docs)
    rows = eval_context(module.model, docs, [4, 16, longest], num_words=dm.num_words["val"], progress=False)
    total = sum(d.numel() - 1 for d in docs)
    assert [r["tokens"] for r in rows] == [total] * 3
    # With the whole document as context the NLL is the full pass's.
    with torch.no_grad():
        full = 0.0
        for doc in docs:
            hidden, _ = module.model.forward_hidden(doc[None, :-1])
            full += float(module.model.token_nll(hidden, doc[None, 1:]).sum())
    assert rows[-1]["nll"] == pytest.approx(full, rel=1e-5)
    assert rows[0]["nll"] != pytest.approx(full, rel=1e-5)  # short windows lose context
    table, plot = write_report(rows, tmp_path)
    assert "word ppl" in table.read_text() and plot.stat().st_size > 1000


# ------------------------------------------------------------------------------- partial validation
def _validate_limited(module, dm, limit) -> dict[str, float]:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=limit)  # fmt: skip
    out = trainer.validate(module, datamodule=ValWithTest(dm), verbose=False)
    return {k: float(v) for d in out for k, v in d.items()}


def _complete_words(sp, text: str, scored: int) -> int:
    """Words of ``text`` whose last character lies in the first ``scored`` targets of its book (BOS is context,
    so targets are its pieces then EOS): counted from the decoded prefix, independently of the data module."""
    ids = sp.encode(text)
    if scored >= len(ids):
        return len(text.split())
    full = " ".join(text.split())
    prefix = sp.decode(ids[:scored]).rstrip()
    assert full.startswith(prefix)
    words = len(prefix.split())
    if prefix and len(prefix) < len(full) and not full[len(prefix)].isspace():
        words -= 1  # the prefix ends inside a word
    return words


@pytest.fixture(scope="module")
def wt103_dm(tmp_path_factory):
    from modality_fixtures import write_wikitext

    from datamodules.wikitext import WikiText103DataModule

    root = tmp_path_factory.mktemp("wteval")
    lines = write_wikitext(root)
    dm = WikiText103DataModule(str(root), batch_size=2, seq_len=16, eval_seq_len=5)
    dm.setup("validate")
    return dm, lines


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_pg19_partial_validation_counts_the_words_of_scored_text(pg19_dm, limit):
    """Uniform model, first ``limit`` segments: word ppl = exp(T log V / W) with T the scored targets and W the
    words completed by them, counted from the decoded text of each book's scored prefix."""
    dm, texts = pg19_dm
    vocab = dm.vocab_size
    module = _module(vocab)
    module.model.token_nll = lambda hidden, target: (target != -100).to(torch.float32) * math.log(vocab)
    metrics = _validate_limited(module, dm, limit)
    for stage, split in (("val", "validation"), ("test", "test")):
        loader = dm.val_dataloader() if stage == "val" else dm.test_dataloader()
        segments = list(loader)[:limit]
        per_book: list[int] = []
        for s in segments:
            if s["first_segment"].item():
                per_book.append(0)
            per_book[-1] += s["target"].shape[1]
        books = sorted(texts[split], key=int)
        words = sum(_complete_words(dm.tokenizer, texts[split][b], n) for b, n in zip(books, per_book))
        tokens = sum(per_book)
        assert 0 < words < dm.num_words[stage]
        assert metrics[f"{stage}/word_ppl"] == pytest.approx(
            math.exp(tokens * math.log(vocab) / words), rel=1e-6
        )


@pytest.mark.parametrize("limit", [1, 3])
def test_wt103_partial_validation_counts_the_words_of_scored_text(wt103_dm, limit):
    """WikiText-103 tokens are words (``<eos>`` included): the scored words are the first ``limit * S`` words of
    the split, so a uniform model's word ppl is exactly V."""
    dm, lines = wt103_dm
    vocab = dm.vocab_size
    module = _module(vocab)
    module.model.token_nll = lambda hidden, target: (target != -100).to(torch.float32) * math.log(vocab)
    metrics = _validate_limited(module, dm, limit)
    for stage, key in (("val", "valid"), ("test", "test")):
        words = [w for line in lines[key] for w in [*line.split(), "<eos>"]][: limit * 5]
        assert len(words) == limit * 5 < dm.num_words[stage]
        assert metrics[f"{stage}/word_ppl"] == pytest.approx(vocab, rel=1e-6)
        assert metrics[f"{stage}/ppl"] == pytest.approx(vocab, rel=1e-6)


@pytest.mark.slow
def test_pg19_small_recipe_limited_validation_is_consistent_with_full(tmp_path):
    """``recipe=pg19_small`` trained two steps, validated in full and with ``limit_val_batches=2`` from the same
    checkpoint: the limited word ppl is exp(NLL of the scored segments / words they complete) and of the
    same size as the full one (it used to be 1.75 against 348,982)."""
    from omegaconf import OmegaConf

    from mega_suite.config import load_config
    from mega_suite.config.run_plan import make_plan
    from mega_suite.training.module import build_module
    from mega_suite.training.runner import run

    data = tmp_path / "data"
    texts = write_pg19(data)
    small = [
        "recipe=pg19_small", f"run_root={tmp_path / 'runs'}", f"data.data_dir={data}", "model.num_layers=1",
        "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
        "model.norm_num_groups=4", "model.cema_ndim=4", "model.chunk_size=16", "data.num_workers=0",
        "data.options.seq_len=32", "data.options.vocab_size=300", "data.options.eval_seq_len=32",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.progress_bar=false",
        "trainer.accelerator=cpu", "trainer.devices=1", "optim.warmup_steps=0", "optim.lr=0.05",
    ]  # fmt: skip
    fit = run(load_config([*small, "trainer.limit_val_batches=1.0", "trainer.limit_test_batches=1.0"]))
    ckpt = Path(fit["run_dir"]) / "checkpoints" / "last.ckpt"
    full = run(load_config([*small, "mode=validate", f"ckpt={ckpt}", "trainer.limit_val_batches=1.0"]))
    part = run(load_config([*small, "mode=validate", f"ckpt={ckpt}", "trainer.limit_val_batches=2"]))

    cfg = load_config(small)
    plan = make_plan(cfg)
    dm = plan.build_data()
    dm.setup("validate")
    module = build_module(
        "lm", plan.with_data(dm).model, optim=OmegaConf.to_container(cfg.optim, resolve=True),
        trainer=OmegaConf.to_container(cfg.trainer, resolve=True), total_steps=2,
    )  # fmt: skip
    module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"])
    module.eval()
    nll, per_book, cache = 0.0, [], None
    with torch.no_grad():
        for s in list(dm.val_dataloader())[:2]:
            if s["first_segment"].item():
                cache, _ = None, per_book.append(0)
            hidden, cache = module.model.forward_hidden(s["input"], cache, use_cache=True)
            nll += float(module.model.token_nll(hidden, s["target"]).sum())
            per_book[-1] += s["target"].shape[1]
    books = sorted(texts["validation"], key=int)
    words = sum(_complete_words(dm.tokenizer, texts["validation"][b], n) for b, n in zip(books, per_book))
    assert part["val/word_ppl"] == pytest.approx(math.exp(nll / words), rel=1e-4)
    assert 0.5 < part["val/word_ppl"] / full["val/word_ppl"] < 2.0


def test_documents_carry_their_own_word_counts(pg19_dm):
    """eval_context over the first N documents divides by those documents' words, not the split's."""
    dm, texts = pg19_dm
    words: list[int] = []
    docs = list(documents_from_segments(dm.val_dataloader(), words))
    assert len(words) == len(docs) >= 2
    assert sum(words) == dm.num_words["val"]
    assert sorted(words) == sorted(len(t.split()) for t in texts["validation"].values())
