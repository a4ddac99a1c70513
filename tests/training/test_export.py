"""Shareable weights: a run's checkpoint (Lightning file, or FSDP2-sharded on 2 gloo ranks) exported as a
safetensors bundle loads back to bit-equal logits through mega_suite.from_pretrained, and to the same logits
(float32 rounding) through transformers' AutoModelForCausalLM (trust_remote_code); tied embeddings export; a bundle is accepted by
ckpt= / init_from=; a bundle with a wrong config is one error line."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from after_fixtures import VOCAB
from safetensors import safe_open
from spawn_support import free_port, spawn

import mega_suite
from mega_suite.cli import main as checkpoint_main
from mega_suite.config import load_config, to_yaml
from mega_suite.config.resolve import model_config
from mega_suite.models import build_model
from mega_suite.models.generation import generate

# the kjv recipe shrunk; tied embeddings (the recipe's share_emb) as in the real run
TINY = [
    "recipe=kjv", "model.num_layers=2", "model.model_dim=32", "model.z_dim=16", "model.value_dim=32",
    "model.ffn_hidden_dim=32", "model.cema_ndim=2", "model.norm_num_groups=4", "model.chunk_size=16",
    "data.options.seq_len=64", "trainer.accelerator=cpu",
]  # fmt: skip


def fake_run(
    folder: Path, arch: str, seed: int = 0, extra: tuple[str, ...] = ()
) -> tuple[Path, torch.nn.Module]:
    """A run directory as fit leaves it: config.yaml and checkpoints/last.ckpt (a Lightning checkpoint);
    ``extra``: more overrides of its configuration."""
    cfg = load_config([*TINY, f"model.arch={arch}", f"run_dir={folder}", *extra])
    torch.manual_seed(seed)
    model = build_model(model_config(cfg, vocab_size=VOCAB)).eval()
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 7}, folder / "checkpoints" / "last.ckpt")
    return folder, model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[0]


TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["megalodon", "llama"])
def test_export_then_load_gives_bit_equal_logits_also_through_transformers(arch, tmp_path, capsys):
    run_dir, model = fake_run(tmp_path / "run", arch)
    assert model.cfg.share_emb
    out = tmp_path / "bundle"
    assert checkpoint_main(["export", str(run_dir), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["step"] == 7
    assert (out / "tokenizer.model").is_file() and config["bos_token_id"] == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    tied = next(iter(config["tied_weights"]))
    assert tied not in names and config["tied_weights"][tied] in names  # stored once

    loaded = mega_suite.from_pretrained(out)
    assert torch.equal(logits(loaded, TOKENS), logits(model, TOKENS))
    embed = loaded.embed.weight
    assert any(p is embed for n, p in loaded.named_parameters(remove_duplicate=False) if "output" in n)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    want = logits(model, TOKENS)  # the bundle's standalone model: same math, its own op order for Megalodon
    torch.testing.assert_close(hf(TOKENS).logits.detach(), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    from datamodules.tokenizer import TextTokenizer

    tok = TextTokenizer(out / "tokenizer.model")
    prompt = torch.tensor([tok.encode("In the beginning")])
    generated = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 5)
    reference = generate(model, prompt, 5, greedy=True)
    assert torch.equal(generated, reference)
    assert isinstance(tok.decode(generated[0].tolist()), str)

    # bf16 parameters in the files, sharded: loads, close to the float32 logits
    small = tmp_path / "bf16"
    assert (
        checkpoint_main(["export", str(out), str(small), "--dtype", "bf16", "--max-shard-size", "100KB"]) == 0
    )
    index = json.loads((small / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    with safe_open(str(small / next(iter(sorted(set(index["weight_map"].values()))))), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert torch.bfloat16 in dtypes
    torch.testing.assert_close(
        logits(mega_suite.from_pretrained(small), TOKENS), logits(model, TOKENS), atol=0.1, rtol=0
    )


def _save_sharded(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from mega_suite.distributed.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config([*TINY, f"run_dir={folder}"])
        torch.manual_seed(0)
        model = build_model(model_config(cfg, vocab_size=VOCAB))
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        state = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
        dcp.save({"state_dict": state}, checkpoint_id=str(Path(folder) / "checkpoints" / "last.ckpt"))
        if rank == 0:
            torch.save({"global_step": 3}, Path(folder) / "checkpoints" / "last.ckpt" / "meta.pt")
    finally:
        dist.destroy_process_group()


def test_export_reads_an_fsdp2_sharded_checkpoint(tmp_path):
    run_dir, model = fake_run(tmp_path / "run", "megalodon")
    (run_dir / "checkpoints" / "last.ckpt").unlink()
    spawn(_save_sharded, 2, 2, free_port(), str(run_dir))
    assert (run_dir / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    out = tmp_path / "bundle"
    assert checkpoint_main(["export", str(run_dir), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["step"] == 3
    assert torch.equal(logits(mega_suite.from_pretrained(out), TOKENS), logits(model, TOKENS))


def test_a_bundle_is_a_checkpoint_for_ckpt_and_init_from_and_a_wrong_one_is_one_error(tmp_path, capsys):
    import run

    run_dir, _ = fake_run(tmp_path / "run", "megalodon")
    bundle = tmp_path / "bundle"
    assert checkpoint_main(["export", str(run_dir), str(bundle)]) == 0
    code = run.main([*TINY, "mode=generate", f"ckpt={bundle}", "prompt=In the beginning", "max_new_tokens=3",
                     "temperature=0", f"run_root={tmp_path / 'gen'}"])  # fmt: skip
    assert code == 0
    from mega_suite.storage.checkpoints import load_into

    target = build_model(model_config(load_config(TINY), vocab_size=VOCAB))
    load_into(target, str(bundle))  # what init_from= and ckpt= call
    assert torch.equal(logits(target, TOKENS), logits(mega_suite.from_pretrained(bundle), TOKENS))

    config = json.loads((bundle / "config.json").read_text())
    for broken, expected in (
        ({**config, "arch": "gpt"}, "arch='gpt'"),
        (
            {**config, "suite_config": {**config["suite_config"], "model_dimm": 3}},
            "unknown megalodon config keys",
        ),
        ({**config, "suite_config": {**config["suite_config"], "model_dim": 64}}, "does not fit the model"),
    ):
        (bundle / "config.json").write_text(json.dumps(broken))
        capsys.readouterr()
        code = run.main(
            [*TINY, "mode=generate", f"ckpt={bundle}", "prompt=x", f"run_root={tmp_path / 'gen'}"]
        )
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and expected in errors[0], errors
    (bundle / "config.json").write_text(json.dumps(config))
    assert checkpoint_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------------------------------------
# what an export copies, casts and ties
# ----------------------------------------------------------------------------------------------------------


def stored(bundle: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a bundle's files, sharded or not, by its stored name."""
    index = bundle / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(bundle / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_a_bf16_export_rounds_each_parameter_once_and_keeps_the_buffers(tmp_path):
    """--dtype bf16: every stored parameter is the float32 one rounded to bf16, every buffer (Megalodon's
    timestep-norm priors: float32 and int64) is stored as it is, the tied output once; loaded back, the model
    is bit for bit the float32 model with its parameters rounded."""
    run_dir, model = fake_run(tmp_path / "run", "megalodon")
    out = tmp_path / "bf16"
    assert (
        checkpoint_main(["export", str(run_dir), str(out), "--dtype", "bf16", "--max-shard-size", "100KB"])
        == 0
    )
    state = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    config = json.loads((out / "config.json").read_text())
    aliases = {a.removeprefix("model.") for a in config["tied_weights"]}
    assert aliases and config["weights_dtype"] == "bfloat16"
    files = stored(out)
    assert set(files) == {f"model.{n}" for n in state if n not in aliases}
    buffers = [n for n in state if n not in params and n not in aliases]
    assert {state[n].dtype for n in buffers} == {torch.float32, torch.int64}
    for name, t in files.items():
        want = state[name.removeprefix("model.")]
        want = want.to(torch.bfloat16) if name.removeprefix("model.") in params else want
        assert t.dtype == want.dtype and torch.equal(t, want), name
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(logits(mega_suite.from_pretrained(out), TOKENS), logits(rounded, TOKENS))


@pytest.mark.parametrize("arch", ["megalodon", "llama"])
def test_an_untied_model_exports_both_matrices_and_loads_untied(arch, tmp_path):
    """model.share_emb=false: the embedding and the output projection are both stored, nothing is listed as
    tied, and both loaders (the suite's, transformers') give the model's logits with two matrices."""
    run_dir, model = fake_run(tmp_path / "run", arch, extra=("model.share_emb=false",))
    assert not model.cfg.share_emb
    out = tmp_path / "bundle"
    assert checkpoint_main(["export", str(run_dir), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["tied_weights"] == {}
    files = stored(out)
    assert set(files) == {f"model.{n}" for n in model.state_dict()}
    assert all(torch.equal(files[f"model.{n}"], t) for n, t in model.state_dict().items())
    loaded = mega_suite.from_pretrained(out)
    embed = loaded.embed.weight
    assert not any(
        p is embed for n, p in loaded.named_parameters(remove_duplicate=False) if n != "embed.weight"
    )
    assert torch.equal(logits(loaded, TOKENS), logits(model, TOKENS))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    want = logits(model, TOKENS)
    torch.testing.assert_close(hf(TOKENS).logits.detach(), want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_the_bundle_carries_the_runs_own_tokenizer_and_its_ids(tmp_path):
    """A run whose tokenizer.model is not the recipe's (BOS 3, EOS 4): the bundle holds that file byte for byte,
    its digest, its BOS / EOS ids in config.json and generation_config.json, and AutoTokenizer encodes as it
    does (with its BOS)."""
    import io

    import sentencepiece as spm

    from datamodules.kjv import TOKENIZER
    from datamodules.tokenizer import TextTokenizer
    from mega_suite.training.trained import file_digest

    run_dir, model = fake_run(tmp_path / "run", "llama")
    words = (
        "light darkness waters firmament heaven earth seed fruit herb tree evening morning day night".split()
    )
    rng = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=rng)) for _ in range(200)
    ]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buffer, vocab_size=300, hard_vocab_limit=False,
        byte_fallback=True, unk_id=0, bos_id=3, eos_id=4, pad_id=-1, minloglevel=2, num_threads=1,
    )  # fmt: skip
    own = run_dir / "tokenizer.model"
    own.write_bytes(buffer.getvalue())
    assert own.read_bytes() != Path(TOKENIZER).read_bytes()
    run_tok = TextTokenizer(own)
    assert (run_tok.bos_id, run_tok.eos_id) == (3, 4)

    out = tmp_path / "bundle"
    assert checkpoint_main(["export", str(run_dir), str(out)]) == 0
    assert (out / "tokenizer.model").read_bytes() == own.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["tokenizer_digest"] == file_digest(own)
    assert (config["bos_token_id"], config["eos_token_id"]) == (3, 4)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (3, 4)
    from transformers import AutoTokenizer

    text = "evening and morning were the first day"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == run_tok.encode(text)
    assert run_tok.encode(text)[0] == 3
