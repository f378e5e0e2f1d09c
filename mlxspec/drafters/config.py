"""The normalised drafter config every on-disk format is read into.

`DrafterSpec` is everything a drafter file says about itself except its block layout;
the format readers produce it. `DrafterConfig` adds the layout (`sample_from_anchor`), a
required field with no default: a loaded drafter gets it from
`mlxspec.drafters.load.resolve_layout`, a new one (training, tests) from its author.
Both are frozen, so a layout cannot be overwritten once set.

Block layout: the block is [anchor, MASK, ..., MASK] at positions p..p+B-1 (p = the
anchor's position).
- anchor-first (True): row k predicts position p+k+1 -> B drafts.
- bonus-anchor (False): row 0 predicts nothing; row j predicts p+j -> B-1 drafts.
`Layout` is that arithmetic, in one place (`DrafterConfig.layout`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Layout:
    """Where a block's drafts sit: rows first_row..B-1 are the predicting rows, and row
    first_row + i predicts position p + 1 + i (p = the anchor's position)."""

    anchor_first: bool  # sample_from_anchor
    block_size: int

    @property
    def first_row(self) -> int:
        return 0 if self.anchor_first else 1

    @property
    def n_drafts(self) -> int:
        return self.block_size - self.first_row

    @property
    def min_block(self) -> int:
        """The shortest block that still drafts one token."""
        return self.first_row + 1

    @property
    def name(self) -> str:
        return "anchor-first" if self.anchor_first else "bonus-anchor"

    def with_block(self, block_size: int) -> "Layout":
        return Layout(self.anchor_first, block_size)


@dataclass(frozen=True)
class DrafterSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    target_layer_ids: list  # "output of layer k" convention (HF hidden_states[k+1])
    mask_token_id: int
    vocab_size: int  # the target vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = False
    confidence_head_with_markov: bool = True
    log_snr: bool = False
    min_log_snr: float = -9.0
    max_log_snr: float = 9.0
    draft_vocab_size: int | None = None  # reduced draft vocabulary (d2t) when set
    # DFlash 2 (Inco AI / z-lab): two-tap dynamic convs around each sublayer and a path
    # selector over the top-k candidates of each row (mlxspec/drafters/dflash2.py)
    conv_kernel_size: int = 0  # taps of the dynamic convs (0: no convs)
    conv_group_size: int = 0  # channels sharing one dynamic coefficient
    selector_rank: int = 0  # codebook rank (0: no selector)
    selector_top_k: int = 0  # candidates per row
    output_multiplier: float = 1.0  # logits * this, then the softcap
    final_logit_softcapping: float | None = None  # tanh(z / cap) * cap when set
    layer_types: tuple | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int | None = None  # sliding layers see context keys k with q - k < window
    block_causal: bool | None = False  # block rows see only earlier block rows; None (z-lab, is_causal absent): in sliding layers
    has_embed: bool = False  # file carries its own embed_tokens
    has_lm_head: bool = False  # file carries its own lm_head
    source_format: str = ""  # provenance: which format
    extra: dict = field(default_factory=dict)

    @property
    def lineage(self) -> str:
        """From the parameters: DFlash 2 iff a path selector (its codebooks and convs are the
        on-disk markers), else DSpark iff a Markov head, else DFlash."""
        if self.selector_rank > 0:
            return "dflash2"
        return "dspark" if self.markov_rank > 0 else "dflash"

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_causal(self, layer: int) -> bool:
        return self.is_sliding(layer) if self.block_causal is None else bool(self.block_causal)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class DrafterConfig(DrafterSpec):
    sample_from_anchor: bool  # the block layout: required, never defaulted
    layout_reason: str = ""  # why the layout is what it is

    @property
    def layout(self) -> Layout:
        return Layout(self.sample_from_anchor, self.block_size)

    @property
    def n_drafts(self) -> int:
        return self.layout.n_drafts
