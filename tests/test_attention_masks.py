"""AttentionPattern.masks: a sliding layer's query at position p sees keys at positions above p - window, on
the host (numpy) and in torch alike; a full layer's mask is the caller's own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoders.core.layer_types import AttentionPattern

WINDOW = 8
HYBRID = AttentionPattern(("sliding_attention", "full_attention", "sliding_attention"), (WINDOW, None, WINDOW))


def by_definition(allowed: np.ndarray, queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    want = allowed.copy()
    for i, p in enumerate(queries):
        for j, position in enumerate(keys):
            want[i, j] &= position > p - WINDOW
    return want


@pytest.mark.parametrize("last", [WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 5])
def test_a_sliding_layer_sees_its_window_on_the_host_and_in_torch(last):
    """Keys at positions 0 .. last, queries at last - 2 .. last: below the window nothing is cut; at it, key 0
    is (a query at the window's position sees positions 1 .. window)."""
    gen = torch.Generator().manual_seed(last)
    keys = np.arange(last + 1)
    queries = np.array([last - 2, last - 1, last, last])  # a tree's nodes share positions
    allowed = (torch.rand(len(queries), len(keys), generator=gen) > 0.2).numpy()
    allowed[:, 0] = True
    want = by_definition(allowed, queries, keys)
    host = HYBRID.masks(allowed, queries, keys)
    device_way = HYBRID.masks(torch.from_numpy(allowed), torch.from_numpy(queries), torch.from_numpy(keys))
    assert set(host) == set(device_way) == {"sliding_attention", "full_attention"}
    np.testing.assert_array_equal(host["sliding_attention"], want)
    np.testing.assert_array_equal(device_way["sliding_attention"].numpy(), want)
    assert host["full_attention"] is allowed
    if last >= WINDOW:
        assert not want[2:, 0].any()  # the window cut what the caller allowed


def test_an_empty_feed_has_empty_masks():
    allowed = np.zeros((0, 3), dtype=np.bool_)
    masks = HYBRID.masks(allowed, np.zeros(0, dtype=np.int64), np.arange(3))
    assert all(m.shape == (0, 3) for m in masks.values())
