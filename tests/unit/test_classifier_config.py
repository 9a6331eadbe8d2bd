"""The flags of classifiers, without a model: --hf-overrides parsed as vLLM's, runner "auto"
resolved to pooling for a *ForSequenceClassification checkpoint (its folder's config.json or
the overrides' architectures), --task classify | score naming --runner pooling, and the
sequence-classification architectures mapped to their causal LM classes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagoda.config import EngineConfig
from pagoda.engine_args import engine_kwargs
from pagoda.models import get_model_class, qwen3
from pagoda.pooler_config import is_classifier, parse_hf_overrides

RERANKER = (
    '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
    '"yes"], "is_original_qwen3_reranker": true}'
)


def test_hf_overrides_parse_as_a_json_object() -> None:
    assert parse_hf_overrides(RERANKER) == json.loads(RERANKER)
    assert parse_hf_overrides({"a": 1}) == {"a": 1}
    assert parse_hf_overrides(None) is None
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        parse_hf_overrides("{")
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        parse_hf_overrides("[1]")


def test_runner_auto_pools_for_a_sequence_classifier(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert EngineConfig(model=str(folder)).runner == "auto"
    assert EngineConfig(model=str(folder), hf_overrides=RERANKER).runner == "pooling"
    assert EngineConfig(model=str(folder), hf_overrides=RERANKER).hf_overrides == json.loads(
        RERANKER
    )
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForSequenceClassification"]})
    )
    assert EngineConfig(model=str(folder)).runner == "pooling"
    assert EngineConfig(model=str(folder), runner="generate").runner == "generate"
    assert is_classifier(["Qwen3ForSequenceClassification"])
    assert not is_classifier(["Qwen3ForCausalLM"])


@pytest.mark.parametrize("task", ["classify", "score", "embed"])
def test_vllm_s_task_names_mean_the_pooling_runner(task: str) -> None:
    assert engine_kwargs(argparse.Namespace(task=task))["runner"] == "pooling"
    with pytest.raises(ValueError, match=f"--task {task} contradicts --runner generate"):
        engine_kwargs(argparse.Namespace(task=task, runner="generate"))


def test_sequence_classifiers_run_on_their_causal_lm_class() -> None:
    assert get_model_class(["Qwen3ForSequenceClassification"]) is qwen3.Qwen3ForCausalLM
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification"):
        get_model_class(["BertForSequenceClassification"])
