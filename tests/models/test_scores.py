"""Scores of --runner pooling classifiers against HF transformers, within 1e-4 per pair: tiny
random Qwen3ForSequenceClassification and LlamaForSequenceClassification checkpoints (the
sigmoid of the `score` head's logit for the tokenizer's text pair, as sentence-transformers'
CrossEncoder scores), and the Qwen3-Reranker recipe on the tiny causal Qwen3 (softmax over
the "no" and "yes" logits at the last position), batched and split over steps (chunked
prefill)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from pagoda import LLM, SamplingParams
from tests.pooling_reference import hf_scores, hf_yes_probs, save_classifier

QUERY = "What does paged attention keep in blocks?"
DOCUMENTS = [
    "Paged attention keeps the KV cache in fixed-size blocks, like virtual memory pages.",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Embeddings map text to vectors; similar texts land close together in that space.",
]
# A 16-token budget splits each pair over several steps.
CHUNKED = dict(max_num_batched_tokens=16, num_gpu_blocks_override=128)
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def classifier_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any
) -> Callable[[str], str]:
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"cls-{arch}")
            made[arch] = save_classifier(folder, arch, smollm2_tokenizer)
        return made[arch]

    return make


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-4, (got, want)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sequence_classifier_scores_equal_hf_s(
    arch: str, classifier_dir: Callable[[str], str], smollm2_tokenizer: Any
) -> None:
    folder = classifier_dir(arch)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    # runner "auto" pools for a *ForSequenceClassification checkpoint (vLLM's rule)
    llm = LLM(folder, **CHUNKED)
    assert llm.config.runner == "pooling"
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = hf_scores(hf, smollm2_tokenizer, pairs)
    assert len({round(w, 3) for w in want}) == len(want)  # the pairs score apart
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)  # 1:N, batched, chunked
    assert [o.prompt_token_ids for o in outs] == [
        smollm2_tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS
    ]
    _close([o.outputs.score for o in outs], want)
    # N:N pairs element-wise; one pair alone
    texts_1 = [DOCUMENTS[1], QUERY]
    nn = llm.score(texts_1, DOCUMENTS[:2], use_tqdm=False)
    _close(
        [o.outputs.score for o in nn],
        hf_scores(hf, smollm2_tokenizer, list(zip(texts_1, DOCUMENTS[:2]))),
    )
    one = llm.classify(QUERY + DOCUMENTS[0], use_tqdm=False)[0]
    assert one.outputs.num_classes == 1
    ids = torch.tensor([smollm2_tokenizer.encode(QUERY + DOCUMENTS[0])])
    with torch.no_grad():
        logit = hf(input_ids=ids).logits[0, 0]
    _close(one.outputs.probs, [float(torch.sigmoid(logit))])


def test_the_qwen3_reranker_recipe_equals_hf_s_yes_probability(
    tiny_model_dir: Callable[[str], str],
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    llm = LLM(tiny_model_dir("qwen3"), hf_overrides=RERANKER, **CHUNKED)
    assert llm.config.runner == "pooling"
    no, yes = smollm2_tokenizer.convert_tokens_to_ids(["no", "yes"])
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = hf_yes_probs(tiny_hf_model("qwen3"), smollm2_tokenizer, pairs, no, yes)
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    _close([o.outputs.score for o in outs], want)


def test_classify_gives_the_softmax_over_several_labels(
    tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    folder = save_classifier(tmp_path / "m", "llama", smollm2_tokenizer, num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, **CHUNKED)
    outs = llm.classify(DOCUMENTS, use_tqdm=False)
    for doc, out in zip(DOCUMENTS, outs, strict=True):
        ids = torch.tensor([smollm2_tokenizer.encode(doc)])
        with torch.no_grad():
            want = torch.softmax(hf(input_ids=ids).logits[0], dim=-1).tolist()
        assert out.outputs.num_classes == 3
        _close(out.outputs.probs, want)
    with pytest.raises(ValueError, match="needs one score per input, but this classifier has 3"):
        llm.score("a", "b", use_tqdm=False)


def test_wrong_calls_for_a_classifier_are_value_errors(
    tmp_path: Path,
    classifier_dir: Callable[[str], str],
    tiny_model_dir: Callable[[str], str],
) -> None:
    llm = LLM(classifier_dir("qwen3"), num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="not embeddings"):
        llm.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="pair 1:1, 1:N or N:N"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="text_2 must not be empty"):
        llm.score("a", [], use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate: run it with --runner pooling"):
        LLM(classifier_dir("qwen3"), runner="generate", num_gpu_blocks_override=64)
    embedder = LLM(tiny_model_dir("qwen3"), runner="pooling", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="LLM.score needs a sequence-classification model"):
        embedder.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="'yes!\\?' is not a token"):
        LLM(
            tiny_model_dir("qwen3"),
            hf_overrides={**RERANKER, "classifier_from_token": ["no", "yes!?"]},
        )
