"""decoders/tuning/forward_split.py: a forward split into linears, attention and the rest, and what holds
it back. Times here only check the attribution (a part slowed on purpose shows where it was slowed);
what this CPU's forwards cost is measured by scripts/profile_device.py --split."""
import time

import pytest
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from decoders.tuning.forward_split import Split, held_back_by, linear_work, split_forwards, timed
from helpers import tiny_lm

SLEEP = 0.02


class SlowLinear(nn.Linear):
    """A linear that sleeps, then calls nn.Linear's forward: a nested call that must be counted once."""

    def forward(self, x):
        time.sleep(SLEEP)
        return super().forward(x)


def test_the_parts_add_up_and_the_work_is_the_models():
    lm = tiny_lm(vocab=64, layers=2, fast_path="none")
    splits = split_forwards(lm, [0, 2, 5], context=8, repeats=3)
    assert [s.tokens for s in splits] == [0, 2, 5]
    linears = [m for m in lm.model.modules() if isinstance(m, nn.Linear)]
    distinct = {m.weight.data_ptr(): m.weight for m in linears}
    for s in splits:
        assert s.linear_s > 0 and s.attention_s > 0 and s.rest_s > 0
        assert s.linear_bytes == sum(w.numel() * 4 for w in distinct.values())
        assert s.linear_flops == sum(2.0 * max(s.tokens, 1) * m.in_features * m.out_features for m in linears)
    assert linear_work(lm.model, 3)[1] == 3 * linear_work(lm.model, 1)[1]


def test_a_slowed_linear_and_a_slowed_attention_show_where_they_were_slowed(monkeypatch):
    lm = tiny_lm(vocab=64, layers=2, fast_path="none")
    (base,) = split_forwards(lm, [4], context=8, repeats=3)
    lm.model.lm_head.__class__ = SlowLinear
    (slowed,) = split_forwards(lm, [4], context=8, repeats=3)
    assert SLEEP <= slowed.linear_s - base.linear_s < 2 * SLEEP  # the nested nn.Linear call counted once
    assert abs(slowed.attention_s - base.attention_s) < SLEEP / 2
    assert held_back_by(slowed, 1e12, 1e15).startswith("linears above their limit")
    lm.model.lm_head.__class__ = nn.Linear

    attend = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def slow_attention(*args, **kwargs):
        time.sleep(SLEEP)
        return attend(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", slow_attention)
    (slow_attn,) = split_forwards(lm, [4], context=8, repeats=3)
    assert slow_attn.attention_s - base.attention_s >= 2 * SLEEP  # one sleep per layer
    assert held_back_by(slow_attn, 1e12, 1e15).startswith("attention")


def test_the_timers_are_gone_after_the_split():
    lm = tiny_lm(vocab=64, layers=2, fast_path="none")
    forward = nn.Linear.forward
    lm.model.lm_head.__class__ = SlowLinear
    with timed(lm.model) as spent:
        assert nn.Linear.forward is not forward and "get_interface" in ALL_ATTENTION_FUNCTIONS.__dict__
        with torch.inference_mode():
            lm.forward([1, 2, 3], lm.new_cache())
        assert spent["linear"] >= SLEEP and spent["attention"] > 0
    assert nn.Linear.forward is forward and SlowLinear.__dict__["forward"].__name__ == "forward"
    assert "get_interface" not in ALL_ATTENTION_FUNCTIONS.__dict__


@pytest.mark.parametrize("linear_s, bytes_, flops, rest_s, says", [
    (0.010, 10e9 * 0.009, 1e9, 0.005, "the rest"),  # linears 1 ms above the read limit; the rest 5 ms
    (0.010, 10e9 * 0.002, 1e12 * 0.009, 0.0005, "linears above their limit (1.0 ms); linears at 90% of their "
                                                "compute limit"),
    (0.010, 10e9 * 0.005, 1e9, 0.001, "linears above their limit (5.0 ms); linears at 50% of their memory limit"),
])
def test_held_back_by_names_the_largest_time_above_a_limit(linear_s, bytes_, flops, rest_s, says):
    split = Split(tokens=8, total_s=linear_s + 0.001 + rest_s, linear_s=linear_s, attention_s=0.001,
                  linear_bytes=int(bytes_), linear_flops=flops)
    assert held_back_by(split, read_bandwidth=10e9, peak_flops=1e12).startswith(says)
