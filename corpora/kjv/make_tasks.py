"""Writes ``corpora/kjv/tasks/``: three small lm-evaluation-harness tasks on held-out KJV verses (the test books,
Jeremiah and Acts, which no suite model trains on), one of each kind the harness has, for ``mode=lm_eval``
offline (docs/after_training.md#lm_eval):

- ``kjv_cloze`` (multiple choice): a verse without its last word; the true word among four;
- ``kjv_verses`` (rolling log-likelihood): whole verses, scored as perplexity;
- ``kjv_complete`` (generate until): the first half of a verse, continued until the end of a clause.

Deterministic (seeded); reads the committed archive. ``python corpora/kjv/make_tasks.py [--n 100]``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_BOOKS = ("24", "44")  # Jeremiah, Acts: corpora/kjv/README.md's test split

YAML = {
    "kjv_cloze": """task: kjv_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: kjv_cloze.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
""",
    "kjv_verses": """task: kjv_verses
dataset_path: json
dataset_kwargs:
  data_files:
    test: kjv_verses.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
metadata: {version: 1.0}
""",
    "kjv_complete": """task: kjv_complete
dataset_path: json
dataset_kwargs:
  data_files:
    test: kjv_complete.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [".", ";", ":", ",", "\\n"], max_gen_toks: 24, do_sample: false}
filter_list:
  - name: strip
    filter: [{function: remove_whitespace}, {function: take_first}]
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true, ignore_punctuation: true}
metadata: {version: 1.0}
""",
}


def verses() -> list[str]:
    with tarfile.open(HERE / "kjv.tar.xz", "r:xz") as tar:
        texts = [tar.extractfile(f"kjv/test/{book}.txt").read().decode() for book in TEST_BOOKS]
    lines = [line.strip() for text in texts for line in text.splitlines()]
    return [v for v in lines if len(v.split()) >= 8 and not v.startswith("Chapter")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="documents per task")
    parser.add_argument("--out", default=str(HERE / "tasks"))
    args = parser.parse_args(argv)
    rng = random.Random(0)
    pool = verses()
    chosen = rng.sample(pool, 3 * args.n)
    last_words = [re.sub(r"\W+$", "", v.split()[-1]) for v in pool]
    cloze, rolling, complete = [], [], []
    for v in chosen[: args.n]:
        words = v.split()
        word = re.sub(r"\W+$", "", words[-1])
        others = rng.sample([w for w in set(last_words) if w and w.lower() != word.lower()], 3)
        choices = [" " + w for w in [word, *others]]
        rng.shuffle(choices)
        cloze.append(
            {"context": " ".join(words[:-1]), "choices": choices, "answer": choices.index(" " + word)}
        )
    for v in chosen[args.n : 2 * args.n]:
        rolling.append({"text": v})
    for v in chosen[2 * args.n :]:
        words = v.split()
        half = len(words) // 2
        rest = re.split(r"[.;:,]", " ".join(words[half:]))[0]
        complete.append({"prompt": " ".join(words[:half]), "answer": rest})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("kjv_cloze", cloze), ("kjv_verses", rolling), ("kjv_complete", complete)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(YAML[name])
    print(f"wrote {len(cloze)} + {len(rolling)} + {len(complete)} documents into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
