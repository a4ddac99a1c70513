"""What each data module feeds the model (its contract) and the options it takes, declared without importing
it (docs/data.md#contracts-and-options).

A recipe is checked against this table before torch or Lightning is imported: ``data.name`` must be a key,
``task`` / ``model.input_type`` / ``model.dual_input`` must fit the contract, and every ``data.options.*``
must be a declared option of a declared type and range (``check_option``), so ``data.options.seq_len=abc``,
``[1, 2]`` or ``-5`` is one error naming the key. ``tests/datamodules/test_contracts.py`` checks that each
data module's ``__init__`` takes exactly these options with these defaults, and that its class attributes
agree with its contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

INT_MAX = 2**31 - 1  # the largest whole number any count or size option accepts


@dataclass(frozen=True)
class Option:
    """One keyword argument of a data module: its type, default and domain.

    ``kind``: int | float | bool | str | path | strs (a string or a list of strings) | ints (a list of whole
    numbers, ``length`` of them). Numbers lie in [low, high] (``low_open``: low excluded); ``none``: None is
    accepted; ``choices``: the only values a string may take."""

    kind: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    none: bool = False
    choices: tuple[str, ...] = ()
    length: int | None = None
    doc: str = ""

    def expected(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        elif self.kind in ("int", "float", "ints"):
            kind = "a whole number" if self.kind != "float" else "a finite number"
            high = INT_MAX if self.high is None and self.kind != "float" else self.high
            if self.low is not None and high is not None:
                text = f"{kind} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(high)}]"
            elif self.low is not None:
                text = f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
            else:
                text = kind
            if self.kind == "ints":
                text = f"a list of {self.length or 'any number of'} values, each {text}"
        else:
            text = {
                "bool": "true or false",
                "str": "a text value",
                "path": "a path",
                "strs": "a text value or a list of them",
            }[self.kind]
        return text + (" or null" if self.none else "")

    def problem(self, value: Any) -> str | None:
        """None when ``value`` is acceptable, else what was expected."""
        if value is None:
            return None if self.none else self.expected()
        ok = {
            "int": lambda v: self._number(v, True),
            "float": lambda v: self._number(v, False),
            "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str) and (not self.choices or v in self.choices),
            "path": lambda v: isinstance(v, str) and bool(v),
            "strs": lambda v: (
                isinstance(v, str)
                or (isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, str) for x in v))
            ),
            "ints": lambda v: (
                isinstance(v, (list, tuple))
                and (self.length is None or len(v) == self.length)
                and all(self._number(x, True) for x in v)
            ),
        }[self.kind](value)
        return None if ok else self.expected()

    def _number(self, value: Any, whole: bool) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if whole and value != int(value):
            return False
        high = INT_MAX if self.high is None and whole else self.high
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return high is None or value <= high


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def count(default, low=0, **kw) -> Option:
    return Option("int", default, low=low, **kw)


def fraction(default, **kw) -> Option:
    return Option("float", default, low=0.0, high=1.0, **kw)


SEED = count(0, high=2**32 - 1)  # numpy's seeds are unsigned 32-bit
SPM_TYPES = ("unigram", "bpe", "char", "word")
PATHFINDER = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")


@dataclass(frozen=True)
class DataContract:
    """A data module: where it lives, what it feeds the model, and its options (beyond the shared keys
    ``data_dir``, ``batch_size``, ``num_workers``, ``seed`` and, where ``takes_length``, ``max_length`` and
    ``pad_to_multiple``)."""

    target: str  # "module:Class"
    task: str  # classify | lm
    input_type: str = "token"  # the model.input_type its batches need
    dual_input: bool = False  # batches of document pairs (retrieval)
    num_classes: int | None = None  # fixed class count (None: the num_classes option, or a language model)
    default_max_length: int | None = None  # its own truncation length (LRA)
    takes_length: bool = False  # takes data.max_length and data.pad_to_multiple
    fixed_length: bool = (
        False  # images of exactly default_max_length pixels: data.max_length cannot change it
    )
    options: dict[str, Option] = field(default_factory=dict)

    @property
    def is_language_model(self) -> bool:
        return self.task == "lm"


_LRA = dict(
    bucket_batches=count(0, doc="sort batches by length within buckets of this many batches (0: off)")
)
_IMAGE = dict(split_seed=count(42, high=2**32 - 1))
_PATHFINDER = dict(
    difficulty=Option("str", "curv_contour_length_14", choices=PATHFINDER),
    split_seed=count(42, high=2**32 - 1),
    val_fraction=fraction(0.1),
    test_fraction=fraction(0.1),
)
_TEXT = dict(
    seq_len=count(1024, low=1, doc="training tokens per sequence"),
    eval_seq_len=count(None, low=1, none=True),
    tokenizer_path=Option("path", None, none=True),
    vocab_size=count(32000, low=8),
    spm_model_type=Option("str", "unigram", choices=SPM_TYPES),
    byte_fallback=Option("bool", True),
    spm_input_sentence_size=count(5_000_000, low=1),
    cache_dir=Option("path", None, none=True),
)

CONTRACTS: dict[str, DataContract] = {
    "listops": DataContract(
        "datamodules.lra:ListOpsDataModule", "classify", num_classes=10, default_max_length=2000,
        takes_length=True,
        options=dict(
            _LRA, generator_seed=SEED,
            generate_sizes=Option("ints", (96000, 2000, 2000), low=1, length=3, doc="train, val, test sizes"),
        ),
    ),
    "lra_text": DataContract(
        "datamodules.lra:IMDBTextDataModule", "classify", num_classes=2, default_max_length=4000,
        takes_length=True, options=dict(_LRA),
    ),
    "lra_retrieval": DataContract(
        "datamodules.lra:AANRetrievalDataModule", "classify", dual_input=True, num_classes=2,
        default_max_length=4000, takes_length=True, options=dict(_LRA),
    ),
    "lra_image": DataContract(
        "datamodules.lra_images:CIFAR10GrayDataModule", "classify", "scalar", num_classes=10,
        default_max_length=1024, takes_length=True, fixed_length=True,
        options=dict(_IMAGE, val_size=count(5000)),
    ),
    "lra_pathfinder": DataContract(
        "datamodules.lra_images:PathfinderDataModule", "classify", "scalar", num_classes=2,
        default_max_length=1024, takes_length=True, fixed_length=True, options=dict(_PATHFINDER),
    ),
    "lra_pathx": DataContract(
        "datamodules.lra_images:PathXDataModule", "classify", "scalar", num_classes=2,
        default_max_length=16384, takes_length=True, fixed_length=True, options=dict(_PATHFINDER),
    ),
    "sc_raw": DataContract(
        "datamodules.speech:SpeechCommandsDataModule", "classify", "scalar", num_classes=10,
        options=dict(
            eval_batch_size=count(None, low=1, none=True), cache_dir=Option("path", None, none=True),
            split_seed=count(0, high=2**32 - 1),
        ),
    ),
    "imagenet": DataContract(
        "datamodules.imagenet:ImageNetDataModule", "classify", "patch",
        options=dict(
            num_classes=count(1000, low=2), image_size=count(224, low=1),
            crop_pct=Option("float", 0.875, low=0.0, high=1.0, low_open=True),
            auto_augment=Option("str", "rand-m9-mstd0.5-inc1", none=True), re_prob=fraction(0.25),
            mixup_alpha=Option("float", 0.8, low=0.0), cutmix_alpha=Option("float", 1.0, low=0.0),
            label_smoothing=Option("float", 0.1, low=0.0, high=0.99), repeated_aug=count(3, low=1),
            eval_batch_size=count(None, low=1, none=True), cache_dir=Option("path", None, none=True),
        ),
    ),
    "wt103": DataContract(
        "datamodules.wikitext:WikiText103DataModule", "lm",
        options=dict(
            seq_len=count(6144, low=1), eval_seq_len=count(None, low=1, none=True),
            chunk_size=count(None, low=1, none=True), min_chunks=count(None, low=1, none=True),
            max_chunks=count(None, low=1, none=True), cache_dir=Option("path", None, none=True),
        ),
    ),
    "pg19": DataContract("datamodules.pg19:PG19DataModule", "lm", options=dict(_TEXT, seq_len=count(8192, low=1))),
    "kjv": DataContract(
        "datamodules.kjv:KJVDataModule", "lm",
        options=dict(_TEXT, tokenizer_path=Option("path", "<repository>/corpora/kjv/kjv_unigram_4096.model", none=True),
                     vocab_size=count(4096, low=8)),
    ),
    "pretrain": DataContract(
        "datamodules.pretrain:PretrainDataModule", "lm",
        options=dict(
            {k: v for k, v in _TEXT.items() if k != "eval_seq_len"}, seq_len=count(4096, low=1), patterns=Option("strs", ("**/*.jsonl", "**/*.jsonl.gz")),
            val_fraction=Option("float", 0.001, low=0.0, high=1.0, low_open=True), split_seed=SEED,
            text_field=Option("str", "text"), bos_token=Option("str", None, none=True),
            eos_token=Option("str", None, none=True), eval_batch_size=count(None, low=1, none=True),
        ),
    ),
}  # fmt: skip
