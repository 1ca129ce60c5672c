"""tiny-random at a published target's shape, and untrained add-ons in the published layouts: what checks
of cost and correctness run where no checkpoint can travel (the GPU kit, scripts/gpu/) or where no shipped
add-on fits the model (scripts/step_overhead.py --untrained). Random weights accept almost nothing, so
such runs measure cost and losslessness, never speed."""
from __future__ import annotations

# tiny-random's knobs (conf/model/tiny-random.yaml) set to a published target's shape.
SHAPES = {
    "vicuna-7b": ["model.name=random-vicuna-7b-shape", "model.num_layers=32", "model.hidden_size=4096",
                  "model.num_heads=32", "model.num_kv_heads=32", "model.intermediate_size=11008",
                  "model.max_position_embeddings=2048", "model.init_std=0.02"],
    "tiny": ["model.num_layers=3"],  # seconds on a CPU
}
# Per decoder, its add-on untrained in the published layout (Medusa-1's five heads, EAGLE-1's draft); every
# draft-model method's draft is the target's first layer without an exit adapter.
UNTRAINED = {"medusa": ["decoder.heads=null", "decoder.num_heads=5"],
             "bpd": ["decoder.heads=null", "decoder.rescore=ngram"],
             "eagle": ["decoder.draft_weights=null"],
             "dflash": ["decoder.draft_weights=null"]}
UNTRAINED_DRAFT = ["draft.layers=1", "draft.adapter=null"]


def untrained(decoder: str) -> list[str]:
    """The overrides that give `decoder` untrained add-ons."""
    return [*UNTRAINED_DRAFT, *UNTRAINED.get(decoder, [])]
