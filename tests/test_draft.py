"""Draft models: the self-draft is exactly the target's first k layers + final norm + head
(shared weights), the exit adapter's file format and errors, the vocabulary check, and
transformers' assisted generation with the same draft."""
import pytest
import torch

from bench.models import TinyRandomModel
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.draft_model import (SelfDraft, build_draft, check_same_vocabulary, load_adapter, new_exit_adapter,
                            save_adapter)
from decoders.methods.hf_peers import HFAssisted
from decoders.core.lm import LM
from decoders.core.sampling import Sampling
from helpers import assert_stored_in_half, round_to_half, tiny_lm

GREEDY = Sampling()


def truncated_logits(lm, ids, layers, adapter=None):
    """The reference: the target's hidden state after `layers` layers, through the final norm and head."""
    with torch.inference_mode():
        hidden = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[layers]
        if adapter is not None:
            hidden = adapter(hidden)
        return lm.model.get_output_embeddings()(lm.model.base_model.norm(hidden))[0]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_self_draft_is_the_truncated_target(layers):
    lm = tiny_lm(seed=layers, layers=4)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    draft = SelfDraft(layers=layers).build(lm)
    torch.testing.assert_close(draft.forward(ids, draft.new_cache()), truncated_logits(lm, ids, layers))
    # incremental decoding with its own cache gives the same rows
    cache = draft.new_cache()
    rows = torch.cat([draft.forward(ids[:5], cache), draft.forward(ids[5:], cache)])
    torch.testing.assert_close(rows, truncated_logits(lm, ids, layers), rtol=1e-4, atol=1e-4)


def test_self_draft_shares_the_targets_weights():
    lm = tiny_lm(seed=0, layers=4)
    draft = SelfDraft(layers=2).build(lm)
    target_ptrs = {p.data_ptr() for p in lm.model.parameters()}
    assert {p.data_ptr() for p in draft.model.parameters()} <= target_ptrs
    assert draft.model.config.num_hidden_layers == 2 and lm.model.config.num_hidden_layers == 4
    assert draft.flops_spec()["n_layers"] == 2


def test_adapter_round_trip_and_effect(tmp_path):
    lm = tiny_lm(seed=1, layers=4)
    ids = [7, 7, 2, 9, 4]
    zero = new_exit_adapter(lm.model)
    torch.testing.assert_close(zero(torch.ones(1, 2, 64)), torch.ones(1, 2, 64))  # zero-initialised: identity
    adapter = new_exit_adapter(lm.model)
    with torch.no_grad():
        adapter.proj.weight.normal_(0, 0.1)
        adapter.norm.weight.mul_(1.5)
    path = tmp_path / "a.safetensors"
    round_to_half(adapter)
    save_adapter(adapter, path, layers=2, info={"note": "test"})
    assert_stored_in_half(path)
    loaded = load_adapter(lm.model, path, layers=2)
    for a, b in zip(adapter.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)
    draft = SelfDraft(layers=2, adapter=str(path)).build(lm)
    got = draft.forward(ids, draft.new_cache())
    torch.testing.assert_close(got, truncated_logits(lm, ids, 2, adapter))
    assert not torch.allclose(got, truncated_logits(lm, ids, 2))
    assert draft.name.endswith("self-2+adapter")


def test_adapter_errors(tmp_path):
    lm = tiny_lm(seed=1, layers=4)
    with pytest.raises(FileNotFoundError, match="no exit adapter at"):
        SelfDraft(layers=2, adapter=str(tmp_path / "missing.safetensors")).build(lm)
    path = tmp_path / "a.safetensors"
    save_adapter(new_exit_adapter(lm.model), path, layers=3, info={})
    with pytest.raises(ValueError, match="trained for 3 layers"):
        SelfDraft(layers=2, adapter=str(path)).build(lm)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not an exit adapter"):
        SelfDraft(layers=2, adapter=str(tmp_path / "other.safetensors")).build(lm)


def test_layer_and_vocabulary_errors():
    lm = tiny_lm(seed=0, layers=3)
    with pytest.raises(ValueError, match=r"draft.layers must be an integer in \[1, 2\] for a 3-layer target, got 3"):
        SelfDraft(layers=3).build(lm)
    with pytest.raises(ValueError, match="draft.layers must be an integer >= 1"):
        SelfDraft(layers=0)
    small = LM(TinyRandomModel(num_layers=1, hidden_size=32, device="cpu", dtype="float32").build(48, None))
    with pytest.raises(ValueError, match="48 output tokens"):
        check_same_vocabulary(lm, small)
    with pytest.raises(ValueError, match="draft=self or a model config"):
        build_draft(object(), lm)


@pytest.mark.parametrize("seed", range(3))
def test_hf_assisted_greedy_equality_and_trace(seed):
    lm = tiny_lm(seed=seed, layers=3)
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = HFAssisted(draft=SelfDraft(layers=1)).generate(lm, prompt, 30, GREEDY, set())
    assert out.tokens == autoregressive_decode(lm, prompt, 30, GREEDY, set()).tokens
    assert sum(s.committed for s in out.steps) == 30
    # the assistant ran before every target pass but possibly the last (nothing left to draft)
    assert all(s.draft_forward_tokens >= 1 and s.draft_time > 0 for s in out.steps[:-1])
    assert len(out.steps) < 30 or all(s.committed == 1 for s in out.steps)
