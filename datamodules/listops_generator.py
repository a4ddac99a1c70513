"""ListOps generator: the suite's embedded copy of LRA's ListOps-1000 data set.

LRA (Tay et al., 2021) generated ListOps without a seed, so only its distribution can be reproduced. A tree
is drawn as in LRA's ``listops.py`` (``max_depth=10``, ``max_args=10``):

- ``tree(depth)``, root at depth 1: at depth >= 10 a leaf; otherwise ``r = random()`` and a leaf (a random
  digit) when ``r > 0.25``, else an operator node whose ``randint(2, 10)`` children are built first, then the
  operator drawn from ``[MIN [MAX [MED [SM``.
- A node counts 2 tokens (operator and ``]``) plus its children; a leaf counts 1. Trees with
  ``500 < tokens < 2000`` are kept, duplicates rejected.
- Values: MIN, MAX, MED = ``int(median)`` (mean of the two middle values for an even count, truncated),
  SM = sum mod 10.
- The string form is left-nested: ``[MAX 2 9]`` is ``( ( ( [MAX 2 ) 9 ) ] )``.

Speed (pure Python, under a minute for the 100k set on one core): the string and
value of every node are built during the draw; a tree is abandoned as soon as its running token count
reaches the maximum; and the integer draws use ``int(random() * k)`` rather than ``randint``/``choice``.
None of this changes the distribution of kept trees: every uniform draw is independent of the past, so
skipping the rest of a doomed tree only shifts which draws later trees consume, and ``int(random() * k)``
is uniform on ``0..k-1`` up to a bias of ``k / 2**53``. What it does change is the stream: the output is
a deterministic function of ``seed``, but not the trees that LRA's code would draw from ``Random(seed)``
(see ``lra_reference_tree`` for that literal port).
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

from tqdm import tqdm

from datamodules.common import partial_name, place_new, sweep_partial_files
from datamodules.errors import DataError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
MAX_DEPTH = 10  # nodes at this depth are leaves (root is depth 1)
MAX_ARGS = 10  # children per operator: randint(2, MAX_ARGS)
VALUE_P = 0.25  # a node is a leaf when random() > VALUE_P
MIN_TOKENS, MAX_TOKENS = 500, 2000  # kept trees satisfy MIN_TOKENS < tokens < MAX_TOKENS
SPLIT_FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}
FOLDER = "listops-1000"

_DIGITS = "0123456789"
# An operator node with n children opens n + 1 pairs: "( " * (n + 1) + op + " " + " ) ".join(children) + " ) ] )"
_OPEN = tuple("( " * (n + 1) for n in range(MAX_ARGS + 1))


def operator_value(op_index: int, values: list[int]) -> int:
    """Value of ``OPERATORS[op_index]`` applied to ``values`` (sorts ``values`` in place for MED)."""
    if op_index == 0:
        return min(values)
    if op_index == 1:
        return max(values)
    if op_index == 2:
        values.sort()
        m = len(values) >> 1
        # int(np.median(...)): the mean of the two middle values, truncated (all values are >= 0)
        return values[m] if len(values) & 1 else (values[m - 1] + values[m]) >> 1
    return sum(values) % 10


class _TooLong(Exception):
    """Raised inside a draw once the tree can no longer be kept."""


class ListOpsSampler:
    """Draws ListOps trees from LRA's distribution with ``rng``; ``sample()`` -> (source, value, tokens) or None.

    ``None`` means the tree was rejected for its length (``tokens <= min_tokens`` or ``>= max_tokens``).
    """

    def __init__(self, rng: random.Random, min_tokens: int = MIN_TOKENS, max_tokens: int = MAX_TOKENS):
        self.random = rng.random
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.tokens = 0  # running token count of the tree being drawn

    def _operator_node(self, depth: int, n_children: int) -> tuple[str, int]:
        # The node's own 2 tokens plus one per child; an operator child adds its surplus when drawn.
        self.tokens += n_children + 1
        if self.tokens >= self.max_tokens:
            raise _TooLong
        random = self.random
        parts: list[str] = []
        values: list[int] = []
        if depth + 1 >= MAX_DEPTH:
            for _ in range(n_children):
                v = int(random() * 10)
                values.append(v)
                parts.append(_DIGITS[v])
        else:
            for _ in range(n_children):
                if random() > VALUE_P:
                    v = int(random() * 10)
                    values.append(v)
                    parts.append(_DIGITS[v])
                else:
                    s, v = self._operator_node(depth + 1, 2 + int(random() * (MAX_ARGS - 1)))
                    values.append(v)
                    parts.append(s)
        op = int(random() * len(OPERATORS))
        source = f"{_OPEN[n_children]}{OPERATORS[op]} {' ) '.join(parts)} ) {CLOSE} )"
        return source, operator_value(op, values)

    def sample(self) -> tuple[str, int, int] | None:
        random = self.random
        if random() > VALUE_P:
            return None  # a single leaf: 1 token (its digit need not be drawn)
        self.tokens = 1  # the root, counted as a leaf until _operator_node adds its surplus
        try:
            source, value = self._operator_node(1, 2 + int(random() * (MAX_ARGS - 1)))
        except _TooLong:
            return None
        if self.tokens <= self.min_tokens:
            return None
        return source, value, self.tokens


def lra_reference_tree(rng: random.Random, depth: int = 1):
    """LRA's ``generate_tree`` ported literally: returns (nested tuple tree, token count).

    Readable reference for the distribution ``ListOpsSampler`` draws from (not used to write data).
    Leaves are ints; an operator node is ``((((op, c1), c2), ...), "]")``.
    """
    r = rng.random() if depth < MAX_DEPTH else 1
    if r > VALUE_P:
        return rng.choice(range(10)), 1
    length = 2
    children = []
    for _ in range(rng.randint(2, MAX_ARGS)):
        child, child_length = lra_reference_tree(rng, depth + 1)
        children.append(child)
        length += child_length
    tree = (rng.choice(OPERATORS), children[0])
    for child in children[1:]:
        tree = (tree, child)
    return (tree, CLOSE), length


def lra_reference_to_string(tree) -> str:
    """LRA's ``to_string``: ``( a b )`` for every pair."""
    if isinstance(tree, str):
        return tree
    if isinstance(tree, int):
        return str(tree)
    return f"( {lra_reference_to_string(tree[0])} {lra_reference_to_string(tree[1])} )"


def generate_listops(
    out_dir: str | os.PathLike,
    n_train: int = 96000,
    n_val: int = 2000,
    n_test: int = 2000,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write ``out_dir/listops-1000/basic_{train,val,test}.tsv`` (header ``Source\\tTarget``).

    Kept trees go, in the order drawn, to train, then val, then test. Writes only where none of the three
    files exists (a ``DataError`` naming those present otherwise, before anything is written): a user's
    split is never written over. The files appear together (each written under a partial name, renamed
    when all are complete; removed by anything that ends the generation early, ``KeyboardInterrupt``
    included). Returns the ``listops-1000`` folder.
    """
    folder = Path(out_dir) / FOLDER
    finals = {split: folder / name for split, name in SPLIT_FILES.items()}
    present = [p.name for p in finals.values() if p.exists()]
    if present:
        missing = [p.name for p in finals.values() if not p.exists()]
        have = f"{', '.join(present)} but not {', '.join(missing)}" if missing else ", ".join(present)
        raise DataError(
            f"{folder} already holds {have}: the ListOps generator writes the three splits only where none "
            "of them exists, so it writes nothing over yours. "
            + (f"Add {', '.join(missing)} from the copy the others came from, or g" if missing else "G")
            + "enerate into another folder (data.data_dir)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    sweep_partial_files(folder)
    sampler = ListOpsSampler(random.Random(seed))
    seen: set[bytes] = set()  # digests, not the ~6 kB strings: the train split alone is ~600 MB of text
    counts = {"train": n_train, "val": n_val, "test": n_test}
    tmp_paths = {split: partial_name(path) for split, path in finals.items()}
    placed: list[Path] = []
    drawn = 0
    try:
        with tqdm(total=sum(counts.values()), desc="ListOps", unit="tree", disable=not progress) as bar:
            for split, count in counts.items():
                with open(tmp_paths[split], "w", encoding="ascii", newline="\n") as f:
                    f.write("Source\tTarget\n")
                    kept = 0
                    while kept < count:
                        drawn += 1
                        tree = sampler.sample()
                        if tree is None:
                            continue
                        source, value, _ = tree
                        digest = hashlib.blake2b(source.encode(), digest_size=16).digest()
                        if digest in seen:
                            continue
                        seen.add(digest)
                        f.write(f"{source}\t{value}\n")
                        kept += 1
                        bar.update()
            bar.set_postfix(accepted=f"{len(seen) / drawn:.1%}")
        for split, path in finals.items():
            place_new(tmp_paths[split], path)  # never replaces a file that appeared meanwhile
            placed.append(path)
        placed = []  # all three are in place: they stay
    except FileExistsError as exc:
        raise DataError(
            f"{exc.filename} appeared while the ListOps generator ran (another process?): "
            "nothing of it was written over; run again"
        ) from None
    finally:
        for path in placed:  # an interrupted set is taken back, so that the folder holds all three or none
            path.unlink(missing_ok=True)
        for path in tmp_paths.values():
            path.unlink(missing_ok=True)
    return folder


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=96000)
    parser.add_argument("--n-val", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        print(generate_listops(args.out_dir, args.n_train, args.n_val, args.n_test, args.seed))
    except DataError as exc:
        parser.exit(2, f"error: {exc}\n")
