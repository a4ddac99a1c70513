"""Language-model evaluation: word-level perplexity normalisation, streaming evaluation, eval_context."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from modality_fixtures import write_pg19

from mega_suite.config import MegalodonConfig
from mega_suite.evaluate import documents_from_segments, eval_context, write_report
from mega_suite.lightning import CausalLM
from mega_suite.runner import ValWithTest

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
