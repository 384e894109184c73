"""Write the local lm-eval tasks for the copy model (JSONL + YAML).

Documents: a random sequence of 200-380 tokens (2-3 CPU KV blocks, 13-24
GPU blocks), the separator, and the first 4-40 tokens of the copy.

* ``copy_mc`` (loglikelihood): which of 8 tokens comes next;
* ``copy_gen`` (generate_until): the next 8 tokens, exact match.

Deterministic: run it again and the files are identical.

The YAMLs load their documents through ``load_copy_dataset`` below
(``custom_dataset: !function make_copy_tasks.load_copy_dataset``; lm-eval
imports the module from the YAML's own folder), which resolves
``data_files`` against this folder: the tasks work from any working
directory (``lm_eval --include_path /abs/eval/tasks``), whereas plain
``dataset_kwargs: data_files`` is resolved against the current directory.

    python eval/tasks/make_copy_tasks.py
"""

from __future__ import annotations

import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
SEED, DOCS, NUM_TOKENS = 2024, 48, 64

MC = """\
task: copy_mc
dataset_path: json
custom_dataset: !function make_copy_tasks.load_copy_dataset
dataset_kwargs:
  data_files:
    test: copy.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
"""

GEN = """\
task: copy_gen
dataset_path: json
custom_dataset: !function make_copy_tasks.load_copy_dataset
dataset_kwargs:
  data_files:
    test: copy.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
target_delimiter: " "
generation_kwargs:
  until: ["|"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    regexes_to_ignore: ["\\\\s+"]
"""


def load_copy_dataset(data_files: dict[str, str], **_metadata):
    """lm-eval ``custom_dataset``: the JSON documents, paths relative to here.

    lm-eval calls it with the task's ``dataset_kwargs`` (and any
    ``--metadata``, ignored).
    """
    import datasets

    files = {split: str(HERE / path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)


def documents() -> list[dict]:
    rng = random.Random(SEED)
    docs = []
    for i in range(DOCS):
        seq = [
            f"t{rng.randrange(NUM_TOKENS):02d}" for _ in range(rng.randint(200, 380))
        ]
        k = rng.randint(4, 40)
        nxt = seq[k]
        others = [f"t{j:02d}" for j in range(NUM_TOKENS) if f"t{j:02d}" != nxt]
        choices = rng.sample(others, 7) + [nxt]
        rng.shuffle(choices)
        docs.append(
            {
                "id": i,
                "context": " ".join(seq) + " | " + " ".join(seq[:k]),
                "choices": choices,
                "gold": choices.index(nxt),
                "answer": " ".join(seq[k : k + 8]),
            }
        )
    return docs


def main() -> None:
    with open(HERE / "copy.jsonl", "w") as f:
        for doc in documents():
            f.write(json.dumps(doc) + "\n")
    (HERE / "copy_mc.yaml").write_text(MC)
    (HERE / "copy_gen.yaml").write_text(GEN)


if __name__ == "__main__":
    main()
