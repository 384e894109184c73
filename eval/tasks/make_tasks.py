"""Write the local lm-eval tasks for the KV-recall model (JSONL + YAML).

Two tasks over the same kind of documents (a key-value list spanning
several KV blocks, then one question):

* ``kv_recall_mc`` (loglikelihood): which of 8 values follows the asked key;
* ``kv_recall_gen`` (generate_until): generate the value, exact match.

Deterministic (fixed seed); run again and the files are identical.

    python eval/tasks/make_tasks.py
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "model"))

from train_recall import NUM_VALUES, render, sample  # noqa: E402

SEED = 4321
DOCS = 64
PAIRS = (60, 90)  # 240-360 list tokens: several 128-token CPU blocks


def documents() -> list[dict]:
    rng = random.Random(SEED)
    docs = []
    for i in range(DOCS):
        table, _ = sample(rng, rng.randint(*PAIRS), 1)
        key, value = table[rng.randrange(len(table) // 4)]  # far back
        context = render(table, []) + f" ? {key} :"
        others = [f"v{j:02d}" for j in range(NUM_VALUES) if f"v{j:02d}" != value]
        choices = rng.sample(others, 7) + [value]
        rng.shuffle(choices)
        docs.append({"id": i, "context": context, "answer": value,
                     "choices": choices, "gold": choices.index(value)})
    return docs


MC_YAML = """\
task: kv_recall_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
"""

GEN_YAML = """\
task: kv_recall_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: answer
target_delimiter: " "
generation_kwargs:
  until: [";"]
  max_gen_toks: 4
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(v\\\\d\\\\d)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def main() -> None:
    data = HERE / "kv_recall.jsonl"
    with open(data, "w") as f:
        for doc in documents():
            f.write(json.dumps(doc) + "\n")
    (HERE / "kv_recall_mc.yaml").write_text(MC_YAML.format(path=data.name))
    (HERE / "kv_recall_gen.yaml").write_text(GEN_YAML.format(path=data.name))
    print(f"wrote {data} and the task YAMLs")


if __name__ == "__main__":
    main()
