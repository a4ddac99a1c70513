"""The bundle's transformers tokenizer, written at export (suite side: this file is not copied into bundles).

``write_hf_tokenizer`` turns the run's tokenizer (a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json``)
into what ``AutoTokenizer.from_pretrained(bundle)`` reads without sentencepiece: a fast ``tokenizer.json`` that
encodes as the run's tokenizer did and adds the BOS the training documents began with (``BOS tokens EOS``),
``tokenizer_config.json`` and ``special_tokens_map.json`` (pad token: EOS, the vocabulary has no pad piece).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def sentencepiece_to_fast(model_path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` equal in encoding to the SentencePiece model (transformers' converter, which
    follows the model's own normaliser, dummy prefix, byte fallback and piece types)."""
    from sentencepiece import sentencepiece_model_pb2
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    kind = proto.trainer_spec.model_type
    if kind == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    elif kind == sentencepiece_model_pb2.TrainerSpec.BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    else:
        raise ValueError(
            f"tokenizer {model_path}: SentencePiece model type {kind} has no fast converter (unigram or BPE)"
        )
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    if tokenizer is None:
        raise ValueError(f"tokenizer {model_path}: transformers could not convert this SentencePiece model")
    unk = proto.pieces[proto.trainer_spec.unk_id].piece if proto.trainer_spec.unk_id >= 0 else None
    return tokenizer, unk


def write_hf_tokenizer(
    source: str | os.PathLike, out_dir: str | os.PathLike, bos_id: int, eos_id: int
) -> dict:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out_dir``;
    returns the token ids for config.json (``bos_token_id``, ``eos_token_id``, ``pad_token_id``)."""
    from tokenizers import Tokenizer, processors

    source, out = Path(source), Path(out_dir)
    if source.suffix == ".json":
        tokenizer = Tokenizer.from_file(str(source))
        unk = getattr(tokenizer.model, "unk_token", None)
    else:
        tokenizer, unk = sentencepiece_to_fast(source)
    bos, eos = tokenizer.id_to_token(bos_id), tokenizer.id_to_token(eos_id)
    if bos is None or eos is None:
        raise ValueError(
            f"tokenizer {source} has no token of id {bos_id if bos is None else eos_id} (BOS / EOS)"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    # pad: EOS, a token the model knows (a new one would need an embedding row it was never trained on)
    special = {"bos_token": bos, "eos_token": eos, "pad_token": eos}
    if unk is not None:
        special["unk_token"] = unk
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # a decoder's batch is padded on the left (the models take no padding mask)
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
