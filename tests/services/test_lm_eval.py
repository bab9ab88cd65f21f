"""lm-eval (0.4.13) against `kvpager serve --http-port`, as its README recipe runs it: a local
multiple-choice (loglikelihood) task and a generate_until task, built here from real text,
through `local-completions` (token-id requests, 4 concurrent), score as lm-eval's own `hf`
backend does on the same fp32 weights: the same accuracies, loglikelihoods within 1e-3 per
choice, the same generations."""

import os
import textwrap
from pathlib import Path

import lm_eval

from tests.services.http_fixture import nats_client, served  # noqa: F401

SENTENCES = [  # (context, continuation) pairs from text the tiny tokenizer was trained on
    ("The quick brown fox jumps over", " the lazy dog."),
    ("Paged attention stores keys and values", " in fixed-size blocks."),
    ("A scheduler batches many requests continuously,", " step after step."),
    ("Once upon a time there was a small language model", " that liked numbers 0123456789."),
    ("def add(a, b):\n   ", " return a + b"),
    ("The lazy dog sleeps while", " the quick brown fox jumps."),
]


def write_tasks(folder: Path) -> None:
    """A multiple-choice task (each context with every continuation as a choice, the real one
    right) and a generation task on the same contexts, stopping at a newline."""
    import json

    endings = [ending for _, ending in SENTENCES]
    with open(folder / "docs.jsonl", "w") as docs:
        for answer, (context, _) in enumerate(SENTENCES):
            docs.write(json.dumps({"context": context, "choices": endings, "answer": answer}))
            docs.write("\n")
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "docs.jsonl"}
        test_split: test
        doc_to_text: "{{{{context}}}}"
    """
    (folder / "kvp_choice.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: kvp_choice
        output_type: multiple_choice
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
          - metric: acc_norm
        """)
    )
    (folder / "kvp_generate.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: kvp_generate
        output_type: generate_until
        doc_to_target: "{{choices[answer]}}"
        target_delimiter: ""
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 12
          do_sample: false
        metric_list:
          - metric: exact_match
        """)
    )


def evaluate(model: str, model_args: str, folder: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvp_choice", "kvp_generate"],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
        device="cpu",
    )


def by_doc(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def test_served_scores_as_hf(served, tiny_llama, tmp_path, nats_client):  # noqa: F811
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    api_args = (
        f"model={tiny_llama.name},base_url={served.api_url}/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tiny_llama},tokenized_requests=True,"
        "num_concurrent=4,max_retries=1,max_length=512"
    )
    served_results = evaluate("local-completions", api_args, tmp_path)
    hf_results = evaluate("hf", f"pretrained={tiny_llama},dtype=float32,max_length=512", tmp_path)
    for task in ("kvp_choice", "kvp_generate"):
        got, want = served_results["results"][task], hf_results["results"][task]
        metrics = [name for name in want if name.endswith(",none") and "stderr" not in name]
        assert metrics and {m: got[m] for m in metrics} == {m: want[m] for m in metrics}, task
    choices = zip(by_doc(served_results, "kvp_choice"), by_doc(hf_results, "kvp_choice"))
    for got, want in choices:
        got_lls = [ll for ll, _ in got["filtered_resps"]]
        want_lls = [ll for ll, _ in want["filtered_resps"]]
        assert len(got_lls) == len(SENTENCES)
        assert max(abs(a - b) for a, b in zip(got_lls, want_lls)) < 1e-3, (got_lls, want_lls)
    generations = zip(by_doc(served_results, "kvp_generate"), by_doc(hf_results, "kvp_generate"))
    for got, want in generations:
        assert got["filtered_resps"] == want["filtered_resps"]
        assert got["filtered_resps"][0], "an empty generation compares nothing"
