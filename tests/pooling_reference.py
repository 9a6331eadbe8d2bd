"""The slow reference of --runner pooling: HF transformers' final hidden states pooled in
torch (what sentence-transformers computes for LAST, MEAN and CLS), and checkpoint folders with
sentence-transformers files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch


def with_files(src: str, dst: Path, files: dict[str, Any]) -> str:
    shutil.copytree(src, dst)
    for name, content in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(json.dumps(content))
    return str(dst)


def sentence_transformers_files(mode: str, normalize: bool) -> dict[str, Any]:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    modes = ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken"]
    pooling = {"word_embedding_dimension": 64, **{m: m == mode for m in modes}}
    return {"modules.json": modules, "1_Pooling/config.json": pooling}


def hf_vectors(
    hf: torch.nn.Module, tokenizer: Any, prompts: list[str], pooling: str, normalize: bool
) -> list[np.ndarray]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            hidden = hf.model(ids).last_hidden_state[0]  # (num_tokens, hidden_size)
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        out.append(vector.numpy())
    return out


def check_close(got: list[list[float]], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        g_arr = np.asarray(g, dtype=np.float64)
        cosine = g_arr @ w / (np.linalg.norm(g_arr) * np.linalg.norm(w))
        assert cosine >= 0.9999, cosine
        # float32 on both sides: lengths agree to float32 rounding over a few layers
        assert np.linalg.norm(g_arr) == pytest.approx(float(np.linalg.norm(w)), rel=1e-4)


def save_classifier(folder: Path, arch: str, tokenizer: Any, num_labels: int = 1) -> str:
    """A tiny random *ForSequenceClassification checkpoint (the tiny `arch`'s config) with the
    SmolLM2 tokenizer: HF's base model and `score` head, no LM head."""
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import _randomize, _tiny_config

    config = _tiny_config(arch)
    config.num_labels = num_labels
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed=7)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def hf_scores(hf: torch.nn.Module, tokenizer: Any, pairs: list[tuple[str, str]]) -> list[float]:
    """sentence-transformers' CrossEncoder score of each pair: the sigmoid of HF's one logit
    for the tokenizer's text pair."""
    out = []
    for a, b in pairs:
        ids = torch.tensor([tokenizer(a, b)["input_ids"]])
        with torch.no_grad():
            out.append(float(torch.sigmoid(hf(input_ids=ids).logits[0, 0])))
    return out


def hf_yes_probs(
    hf: torch.nn.Module, tokenizer: Any, pairs: list[tuple[str, str]], no: int, yes: int
) -> list[float]:
    """The Qwen3-Reranker score: softmax over the ["no", "yes"] logits at the last position."""
    out = []
    for a, b in pairs:
        ids = torch.tensor([tokenizer(a, b)["input_ids"]])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, -1, [no, yes]]
        out.append(float(torch.softmax(logits, dim=-1)[1]))
    return out
