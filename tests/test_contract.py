"""The method contract's optional parts are declared in decoders/core/contract.py and checked: a method that
drafts in the shared loop declares its widest step (else the memory estimate would count one token), and a
proposer that waits for the prefill says what that pass returns (hidden, feature_layers); each is refused
in one line naming what is missing. Every method of ours meets it."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.registry import decoder_configs
from decoders.core.contract import (Batches, DeclaresStep, WaitsForPrefill, check_proposer, decode_one,
                                    widest_step)
from decoders.core.loop import Proposal
from decoders.core.sampling import Sampler, Sampling
from decoders.core.tree import TokenTree
from helpers import REPO, tiny_lm


class Chain:
    def __init__(self, waits: bool, says: dict):
        self.waits_for_prefill = waits
        for key, value in says.items():
            setattr(self, key, value)

    def propose(self, sequence, room):
        return Proposal(TokenTree.chain(sequence[-1], [sequence[-1]][:room]))

    def commit(self, proposal, scores, path, sequence):
        return {}


@dataclass
class Drafting:
    name: str = "drafting"
    lossless: bool = True
    waits: bool = False
    says: dict | None = None

    def proposer(self, lm, prompt_ids, sampler, stop_ids):
        return Chain(self.waits, self.says or {}), None

    generate = decode_one


def test_a_method_in_the_shared_loop_declares_its_widest_step():
    assert isinstance(Drafting(), Batches) and not isinstance(Drafting(), DeclaresStep)
    with pytest.raises(TypeError, match="decoder drafting drafts in the shared loop but declares no widest_step"):
        widest_step(Drafting())
    declared = Drafting()
    declared.widest_step = 2
    assert widest_step(declared) == 2
    assert widest_step(object()) == 1  # transformers' generate(): one token a step, no loop of ours


@pytest.mark.parametrize("says, ok", [({"hidden": False, "feature_layers": False}, True), ({"hidden": True}, False),
                                      ({}, False)])
def test_a_proposer_that_waits_for_the_prefill_says_what_that_pass_returns(says, ok):
    proposer = Chain(waits=True, says=says)
    assert isinstance(proposer, WaitsForPrefill) == ok
    if ok:
        assert check_proposer(proposer) is proposer
    else:
        with pytest.raises(TypeError, match="Chain sets waits_for_prefill but not both hidden and feature_layers"):
            check_proposer(proposer)
        with pytest.raises(TypeError, match="waits_for_prefill"):  # decode_one checks it before decoding
            Drafting(waits=True, says=says).generate(tiny_lm(), [1, 2, 3], 4, Sampling(), set())
    assert check_proposer(Chain(waits=False, says={})) is not None  # asked at the prefill: nothing to say


NEED_MORE = ("medusa", "bpd", "eagle", "dflash", "spec_chain", "specinfer", "sequoia", "oracle")


@pytest.mark.parametrize("name", decoder_configs())
def test_every_method_meets_the_contract(name):
    from hydra import compose, initialize_config_dir

    from bench.runner import check_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"decoder={name}", "model=tiny-random"])
    _, decoder = check_config(cfg)
    assert widest_step(decoder) >= 1
    # methods needing no add-on and no foreseen continuation build their proposer on a tiny model here; the
    # others' proposers are checked by decode_one in every test that decodes with them
    if isinstance(decoder, Batches) and name not in NEED_MORE:
        lm = tiny_lm(vocab=64)
        check_proposer(decoder.proposer(lm, [1, 2, 3], Sampler(Sampling(), lm.output_device), set())[0])
