"""Weights load with one CPU thread fewer than torch's (pagoda/loading/loader.py): the count is
restored afterwards, and the loaded weights do not depend on it, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.loading.loader import _loading_threads, load_model


@pytest.fixture
def threads() -> Iterator[int]:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_loading_threads_leave_a_core_and_restore(threads: int) -> None:
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        with _loading_threads():
            assert torch.get_num_threads() == max(1, n - 1)
        assert torch.get_num_threads() == n
    with pytest.raises(RuntimeError), _loading_threads():
        raise RuntimeError("a failed load")
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("quantization", [None, "none"])
def test_weights_do_not_depend_on_the_thread_count(
    smollm2_path: str, quantization: str | None, threads: int
) -> None:
    config = EngineConfig(model=smollm2_path, device="cpu", quantization=quantization)
    loaded = []
    for n in (1, 3):  # loading with 1 and 2 threads
        torch.set_num_threads(n)
        model = load_model(config, load_tokenizer=False)[0]
        loaded.append(dict(model.state_dict(keep_vars=False)))
    one, two = loaded
    assert one.keys() == two.keys() and one
    for name, tensor in one.items():
        other = two[name]
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, name
        assert torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), name
