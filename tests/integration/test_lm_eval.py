"""A real tool on the OpenAI API: lm-eval's `local-completions` model scoring a multiple-choice task (defined from a
local JSON file) through the stack, against lm-eval's `hf` backend on transformers' fp32 model of the same file."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
QUESTIONS = [("The capital of France is", ["Paris", "Rome", "Berlin"], 0),
             ("The capital of Japan is", ["Seoul", "Tokyo", "Beijing"], 1),
             ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Newton"], 0),
             ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter"], 2),
             ("A week has seven", ["days", "hours", "months"], 0),
             ("The opposite of hot is", ["warm", "cold", "loud"], 1),
             ("Two plus two equals", ["five", "three", "four"], 2),
             ("The sun rises in the", ["east", "west", "north"], 0),
             ("Bees make", ["honey", "milk", "silk"], 0),
             ("The chemical symbol for gold is", ["Ag", "Au", "Fe"], 1),
             ("A baby cat is called a", ["puppy", "kitten", "calf"], 1),
             ("The color of the sky on a clear day is", ["green", "red", "blue"], 2)]
TASK = """task: upesi_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-eval-task")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (d / "upesi_mc.yaml").write_text(TASK.format(data=data))
    return d


def accuracy(model, task_dir) -> tuple[float, list]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    out = simple_evaluate(model=model, tasks=["upesi_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                          log_samples=True, bootstrap_iters=0)
    samples = out["samples"]["upesi_mc"]
    return out["results"]["upesi_mc"]["acc,none"], [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_local_completions_scores_as_the_hf_backend(spec_stack, hf_model, hf_tokenizer, model_path, task_dir):
    pytest.importorskip("lm_eval", reason="lm-eval is a test dependency")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from shared.tokenizer import Tokenizer
    api = LocalCompletionsAPI(model="SmolLM2-135M-Instruct", tokenizer=Tokenizer(model_path).folder,
                              base_url=f"http://127.0.0.1:{spec_stack.http_port}/v1/completions",
                              tokenizer_backend="huggingface", max_retries=1, num_concurrent=1)
    served, served_resps = accuracy(api, task_dir)
    local, local_resps = accuracy(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=4), task_dir)
    print(f"lm-eval acc: local-completions {served:.4f}, hf {local:.4f}")
    assert abs(served - local) <= 0.01 and served >= 0.5
    for a, b in zip(served_resps, local_resps):                    # each choice's log-likelihood and greediness
        for (lp_a, greedy_a), (lp_b, greedy_b) in ((x[0], y[0]) for x, y in zip(a, b)):
            assert abs(lp_a - lp_b) < 0.05 and greedy_a == greedy_b
