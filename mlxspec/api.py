"""Python API in mlx-lm's idiom: `load`, `generate`, `stream_generate`.

    from mlxspec import load, generate
    model, tokenizer, speculator = load(draft="auto")   # default SmolLM2 + shipped DSpark
    text = generate(model, tokenizer, "Write a haiku", speculator=speculator, max_tokens=64)

`model` is an mlxspec `Target` (wrapping an mlx-lm model). An app that already holds an
mlx-lm model can pass it straight in: `generate(mlx_lm_model, mlx_lm_tokenizer, ...)`
(wrapped on the fly), with `Speculator.build(SpecConfig(draft=path), model)` for the drafter.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from mlxspec.drafters.load import load_drafter
from mlxspec.drafters.registry import Identity, candidates, describe, identify, lookup
from mlxspec.engine.drafting import BlockDrafter, NoDrafter, SimpleDrafter
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.tree_step import TreeSettings
from mlxspec.engine.ngram import LOOKUP_MAX, LookupBlockDrafter, NgramDrafter
from mlxspec.engine.policy import FixedLength, LengthPolicy, PolicyMemory, VerifyPolicy, compose
from mlxspec.engine.profile import verify_profile
from mlxspec.engine.suffix import SuffixIndex, SuffixLookup
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.logger import say
from mlxspec.targets.load import load_target
from mlxspec.targets.model import Target
from mlxspec.validate import check_prompt_ids, check_sampling_args, check_spec_args, check_text

SPEC_TYPES = ("auto", "draft-dflash", "draft-dspark", "draft-dflash2", "draft-eagle3", "draft-simple", "ngram", "none")
VERIFY_POLICIES = ("adaptive", "fixed")
LOOKUPS = ("ngram", "suffix")
SUFFIX_BUDGET = 65536  # tokens in a speculator's shared suffix index (~50 MB in CPython)
SHIPPED = Path(__file__).parent / "weights"
DEFAULT_TARGET = "SmolLM2-135M-Instruct"  # load(None): its drafter is the registry's first shipped entry


def shipped_drafter(kind: str = "dspark") -> Path | None:
    """Path of a drafter shipped with mlxspec for the default target, if present."""
    p = SHIPPED / f"smollm2-135m-{kind}"
    return p if p.exists() else None


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How to speculate, as `mlxspec generate`'s flags say it (`mlxspec.args.spec_config`
    builds one from them): checked once, here, and taken whole by `load`, the server,
    distributed, bench and evaluate.

    draft: a drafter path (dir or .gguf) or hub id, "auto" (`resolve_auto_draft`), or None /
    "none" (no drafter; spec_type "none" means the same). policy: "adaptive" | "fixed" | None
    (adaptive unless block_size, num_draft_tokens or schedule pins the length). ngram: prompt
    lookup beside a block drafter (--ngram; on by default). lookup: what the model-free lookup
    is (--lookup): "ngram" (prompt lookup, the default) or "suffix" (suffix drafting,
    `mlxspec.engine.suffix`: also from the speculator's earlier requests, up to suffix_budget
    tokens of their outputs; 0: this request only). shard: None (one process), or the
    target sharded over the ranks of an `mlx.launch` job (`--ranks`): a
    `mlxspec.distributed.Sharding`, which `load` asks for the target with
    `shard.load_target(model) -> (target, tokenizer, speculates)`."""

    draft: str | None = "auto"
    spec_type: str = "auto"
    block_size: int | None = None
    num_draft_tokens: int | None = None
    p_min: float | None = None
    schedule: bool = False
    policy: str | None = None
    ngram: bool = True
    shard: object = None
    lookup: str = "ngram"
    suffix_budget: int = SUFFIX_BUDGET
    tree: str | int = "off"  # --tree: off (chains), auto (nodes chosen by cost), or a node count

    def __post_init__(self):
        d = self.draft
        if d is not None and not isinstance(d, (str, os.PathLike)):
            raise MlxspecError(f"draft={d!r}: pass a path (or a Hugging Face repo id) as a string, or None")
        if d is not None and not str(d).strip():
            raise MlxspecError("--draft is empty: pass a .gguf file, a directory or a Hugging Face repo id, 'auto' or 'none'")
        if self.spec_type not in SPEC_TYPES:
            raise MlxspecError(f"--spec-type {self.spec_type!r} is not one of {', '.join(SPEC_TYPES)}")
        check_spec_args(self.block_size, self.num_draft_tokens, self.p_min)
        if self.policy is not None and self.policy not in VERIFY_POLICIES:
            raise MlxspecError(f"--verify-policy {self.policy!r} is not one of {', '.join(VERIFY_POLICIES)}")
        if self.lookup not in LOOKUPS:
            raise MlxspecError(f"--lookup {self.lookup!r} is not one of {', '.join(LOOKUPS)}")
        if not isinstance(self.suffix_budget, int) or self.suffix_budget < 0:
            raise MlxspecError(f"--suffix-budget {self.suffix_budget!r}: pass a number of tokens >= 0 (0: no shared index)")
        TreeSettings.parse(self.tree)
        if self.shard is not None and not callable(getattr(self.shard, "load_target", None)):
            raise MlxspecError(f"shard={self.shard!r}: pass a mlxspec.distributed.Sharding(mode=..., check=..., "
                               "timeout=...), or None for one process")
        if d == "none" or self.spec_type == "none":
            object.__setattr__(self, "draft", None)
        elif isinstance(d, os.PathLike):
            object.__setattr__(self, "draft", os.fspath(d))

    @property
    def verify_policy(self) -> str:
        """The policy in force: the one asked for, else fixed when a flag pins the length."""
        pinned = self.block_size is not None or self.num_draft_tokens is not None or self.schedule
        return self.policy or ("fixed" if pinned else "adaptive")


@dataclass(kw_only=True)
class Speculator:
    """How to speculate: a drafter plus the knobs of the loop (`Speculator.build` makes one
    from a `SpecConfig`; `session` runs one request with it)."""

    drafter_factory: object = None  # callable(target) -> Drafter, or None (autoregressive)
    spec_type: str = "none"
    p_min: float | None = None
    schedule: bool = False
    num_draft_tokens: int | None = None
    description: str = "autoregressive"
    # adaptive: the verify length (down to 0 = an autoregressive step) is chosen each step
    # from the measured verify cost and the acceptance seen so far (engine/policy.py);
    # fixed: always the full block / num_draft_tokens (--schedule and p_min apply)
    policy: str = "adaptive"
    memory: PolicyMemory = field(default_factory=PolicyMemory, repr=False, compare=False)
    # suffix drafting's shared index (`build` gives one to a speculator with lookup="suffix"):
    # what this speculator's requests generated, so that each request drafts from the earlier
    # ones too (None: each request only from itself, or no suffix drafting)
    suffix: SuffixIndex | None = field(default=None, repr=False, compare=False)
    # trees of candidates per step instead of chains (`mlxspec.engine.tree_step`)
    tree: TreeSettings = field(default_factory=TreeSettings)

    def make_drafter(self, target, shared=None):
        """A new drafter for one request (a suffix lookup drafts from `shared`, default: this
        speculator's own shared index)."""
        d = self.drafter_factory(target) if self.drafter_factory else NoDrafter()
        self.use_shared(d, self.suffix if shared is None else shared)
        return d

    @staticmethod
    def use_shared(drafter, shared: SuffixIndex | None) -> None:
        """Point a drafter's suffix lookup (if it has one) at a shared index: the server keeps
        one per API key and sets it per request on its pooled drafters."""
        index = getattr(drafter, "index", None)
        if isinstance(index, SuffixLookup):
            index.shared = shared

    @classmethod
    def build(cls, config: SpecConfig, target, *, model: str | None = None, log=None) -> "Speculator":
        """The speculator `config` describes, for an already loaded `target` (a `Target`, an
        mlx-lm model or distributed's target). model: the target's path or id, which
        `draft="auto"` is resolved for (None: the default model)."""
        target = as_target(target)
        draft, spec_type = config.draft, config.spec_type
        if draft == "auto":
            draft, spec_type = resolve_auto_draft(model, spec_type, ngram=config.ngram, log=log)
        spec = _build(config, draft, spec_type, target, log)
        spec.tree = TreeSettings.parse(config.tree)
        if spec.tree.on and spec.drafter_factory is not None:
            spec.description += f" tree={'auto' if spec.tree.mode == 'auto' else spec.tree.nodes}"
        return spec

    def session(self, target, prompt_ids: list[int], *, max_tokens: int = 256,
                sampling: SamplingParams = SamplingParams(), seed: int | None = 0,
                eos_ids: set[int] | frozenset = frozenset(), stats: SpecStats | None = None,
                cache: list | None = None, drafter=None, check_invariants: bool = True) -> Iterator[list[int]]:
        """One request: the drafter (a new one unless given), its verify-length policy and the
        loop (`generate_steps`, whose committed-token lists this yields). Every driver (the
        API, the server, evaluate, bench, distributed) runs requests through here."""
        target = as_target(target)
        drafter = self.make_drafter(target) if drafter is None else drafter
        policy = make_policy(target, drafter, self, sampling.temperature)
        return generate_steps(target, prompt_ids, drafter=drafter, max_tokens=max_tokens, sampling=sampling, seed=seed,
                              eos_ids=eos_ids, policy=policy, stats=stats, check_invariants=check_invariants,
                              cache=cache, tree=self.tree)


@dataclass
class GenerationResponse:
    """mlx_lm.generate.GenerationResponse's fields plus speculative statistics."""

    text: str
    token: int
    logprobs: mx.array | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    acceptance_rate: float = 0.0
    tau: float = 1.0
    stats: SpecStats | None = None


_UNSET = object()


def load(model: str | None = None, draft=_UNSET, *, config: SpecConfig | None = None, log=None, **fields):
    """-> (target, tokenizer, speculator).

    model: .gguf file or MLX/HF dir or hub id; None = the default SmolLM2-135M-Instruct.
    config: how to speculate (`SpecConfig`; default: `--draft auto` with the adaptive policy
    and prompt lookup). draft and the keyword fields (spec_type, block_size,
    num_draft_tokens, p_min, schedule, policy, ngram, shard) replace the config's own:
    `load(model, "path/to/drafter", policy="fixed")`.

    With `shard` (`mlxspec.distributed.Sharding`), every rank of an `mlx.launch` job calls
    `load` the same way and gets the target sharded over the ranks (a `DistTarget`): rank 0
    gets the speculator and generates, the others get None and call `target.serve()`
    (docs/distributed.md).
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise MlxspecError(f"model={model!r}: pass a path (or a Hugging Face repo id) as a string, or None")
    if draft is not _UNSET:
        fields["draft"] = draft
    config = replace(config or SpecConfig(), **fields) if fields else (config or SpecConfig())  # checked on every rank
    if config.shard is not None:
        target, tok, speculates = config.shard.load_target(model)
        return target, tok, (Speculator.build(config, target, model=model, log=log) if speculates else None)
    target, tok = load_target(model)
    return target, tok, Speculator.build(config, target, model=model, log=log)


def resolve_auto_draft(model: str | None, spec_type: str = "auto", *, ngram: bool = True,
                       log=None) -> tuple[str | None, str]:
    """What `--draft auto` means for `model` -> (drafter path or None, spec type).

    The default model (`model=None`): its shipped DSpark drafter
    (`mlxspec/weights/smollm2-135m-dspark`). Another target is recognised by its contents
    (`mlxspec.drafters.registry.identify`: a packaged GGUF's sha256, GGUF names, config.json
    `_name_or_path`, the hub id or file name, then architecture and vocabulary) and gets its
    most preferred entry in the drafter registry (`mlxspec/data/registry.json`: published DSpark /
    DFlash / DFlash 2 repos and the shipped drafters), named in one line (`mlxspec.logger.say`). A target with no known drafter gets
    model-free prompt lookup (spec type "ngram") under the adaptive verify policy, which
    verifies a lookup only while it pays and otherwise takes one-token steps (measured on
    Qwen2.5-Coder-0.5B: 1.27x autoregressive greedy, 1.02x at T=1; docs/bench-qwen2.5-coder-0.5b);
    with `ngram=False` (--no-ngram) it runs autoregressive.
    """
    if spec_type in ("none", "ngram", "draft-simple"):  # no block drafter asked for
        return None, spec_type
    if model is None:  # the default target: its first registry entry that is shipped here
        ship = next((Path(e["path"]) for e in candidates(DEFAULT_TARGET, Identity(DEFAULT_TARGET.lower(), "default"))
                     if Path(e["path"]).exists()), None) or shipped_drafter("dspark")
        return (str(ship) if ship else None), spec_type
    ident = identify(str(model))  # by content: a renamed or converted copy is the same model
    entry = lookup(str(model), ident)
    if entry is None:
        if spec_type != "auto":  # a lineage was asked for: load_speculator says to pass --draft PATH
            return None, spec_type
        say(f"mlxspec: --draft auto: {describe(str(model), ngram=ngram, ident=ident)}", log)
        return None, "ngram" if ngram else "auto"
    say(f"mlxspec: --draft auto: {describe(str(model), ident=ident)}", log)
    return entry["path"], spec_type


def load_speculator(draft: str | None, target: Target, *, spec_type: str = "auto", block_size: int | None = None,
                    num_draft_tokens: int | None = None, p_min: float | None = None, schedule: bool = False,
                    log=None, policy: str | None = None, ngram: bool = False) -> Speculator:
    """Deprecated: `Speculator.build(SpecConfig(...), target)`. Kept, with its old
    `ngram=False` default, for callers written before `SpecConfig`."""
    cfg = SpecConfig(draft=draft, spec_type=spec_type, block_size=block_size, num_draft_tokens=num_draft_tokens,
                     p_min=p_min, schedule=schedule, policy=policy, ngram=ngram)
    return _build(cfg, cfg.draft, cfg.spec_type, as_target(target), log)


def _build(sc: SpecConfig, draft: str | None, spec_type: str, target: Target, log) -> Speculator:
    """The speculator for a resolved drafter path and spec type (`--draft auto` already decided)."""
    block_size, num_draft_tokens, p_min, schedule, ngram = sc.block_size, sc.num_draft_tokens, sc.p_min, sc.schedule, sc.ngram
    policy = sc.verify_policy
    suffix = sc.lookup == "suffix"
    index, shared = _lookup_index(sc), {"suffix": _shared_suffix(sc)}
    if spec_type == "ngram":
        n = num_draft_tokens or (8 if policy != "adaptive" else LOOKUP_MAX)  # the adaptive policy verifies what pays
        vocab = target.info.vocab_size
        return Speculator(drafter_factory=lambda t: NgramDrafter(vocab, n, index=index()), spec_type=sc.lookup, p_min=None,
                          schedule=False, num_draft_tokens=n, policy=policy, **shared,
                          description=f"{'suffix' if suffix else 'ngram prompt'} lookup n={n}")
    if spec_type == "none" or (draft is None and spec_type == "auto"):
        return Speculator()
    if draft is None:
        raise MlxspecError(f"--spec-type {spec_type} needs a drafter: pass --draft PATH")
    if spec_type == "draft-simple":
        dmodel, dtok = load_target(draft)
        if dmodel.info.vocab_size != target.info.vocab_size:
            raise MlxspecError(
                f"{draft}: draft model vocabulary ({dmodel.info.vocab_size}) differs from the target's "
                f"({target.info.vocab_size}); draft-simple needs a model with the same tokenizer"
            )
        n = num_draft_tokens or 4
        return Speculator(drafter_factory=lambda t: SimpleDrafter(dmodel, n), spec_type="draft-simple", p_min=None, schedule=False, num_draft_tokens=n,
                          description=f"draft-simple {Path(draft).name} n={n}", policy=policy)

    dmodel, cfg = load_drafter(draft, target.info, requested=spec_type, log=log)
    if cfg.lineage == "eagle3":
        return _build_eagle3(sc, dmodel, cfg, draft, policy, log)
    if num_draft_tokens is not None:
        say(f"mlxspec: warning: --num-draft-tokens applies to draft-simple and ngram; the {cfg.lineage} "
            "block drafter ignores it (use --block-size to shorten its block)", log, logging.WARNING)
    if block_size is not None:
        if block_size > cfg.block_size:
            raise MlxspecError(
                f"--block-size {block_size} is longer than the drafter's trained block ({cfg.block_size}); "
                f"use --block-size {cfg.block_size} or less"
            )
        if block_size < cfg.layout.min_block:
            raise MlxspecError(f"--block-size {block_size} leaves no draft rows; use {cfg.layout.min_block} or more")
    if (p_min is not None or schedule) and not cfg.confidence_head:
        say(f"mlxspec: warning: {Path(draft).name} has no confidence head; "
            "--p-min / --schedule are ignored (full blocks are verified)", log, logging.WARNING)
        p_min, schedule = None, False
    bs = block_size or cfg.block_size
    if ngram:
        lmax = _lookup_max(sc)
        return Speculator(drafter_factory=lambda t: LookupBlockDrafter(BlockDrafter(dmodel, t, bs), t.info.vocab_size,
                                                                       index=index(), lookup_max=lmax),
                          spec_type=f"draft-{cfg.lineage}+{sc.lookup}", p_min=p_min, schedule=schedule, num_draft_tokens=None,
                          description=f"{cfg.lineage}+{sc.lookup} {Path(draft).name} block={bs}"
                                      + (f" lookup<={lmax}" if lmax else ""), policy=policy, **shared)
    return Speculator(drafter_factory=lambda t: BlockDrafter(dmodel, t, bs), spec_type=f"draft-{cfg.lineage}", p_min=p_min, schedule=schedule, num_draft_tokens=None,
                      description=f"{cfg.lineage} {Path(draft).name} block={bs}", policy=policy)


def _lookup_max(sc: SpecConfig) -> int:
    """How many drafts prompt lookup / suffix drafting may propose beside a model drafter: up to
    `LOOKUP_MAX` under the adaptive policy (it verifies only as many as pay), the drafter's own
    length where a flag pins lengths (--verify-policy fixed, --block-size, --num-draft-tokens)."""
    pinned = sc.verify_policy != "adaptive" or sc.block_size is not None or sc.num_draft_tokens is not None
    return 0 if pinned else LOOKUP_MAX


def _lookup_index(sc: SpecConfig):
    """The lookup index each drafter gets: a new SuffixLookup for lookup="suffix", else None
    (the drafters' own NgramIndex)."""
    return (lambda: SuffixLookup()) if sc.lookup == "suffix" else (lambda: None)


def _shared_suffix(sc: SpecConfig) -> SuffixIndex | None:
    return SuffixIndex(sc.suffix_budget) if sc.lookup == "suffix" and sc.suffix_budget else None


def _build_eagle3(sc: SpecConfig, dmodel, cfg, draft: str, policy: str, log) -> Speculator:
    """A chain drafter: --num-draft-tokens (or --block-size, as drafts + 1) caps the chain."""
    n = sc.num_draft_tokens or (sc.block_size - 1 if sc.block_size else None) or cfg.max_drafts
    if n < 1:
        raise MlxspecError("--block-size 1 leaves no drafts for an EAGLE-3 chain; use 2 or more")
    if sc.p_min is not None or sc.schedule:
        say(f"mlxspec: warning: {Path(draft).name} has no confidence head; --p-min / --schedule are ignored",
            log, logging.WARNING)

    index, lmax = _lookup_index(sc), _lookup_max(sc)

    def make(t):
        d = Eagle3Drafter(dmodel, cfg, t, n)
        return LookupBlockDrafter(d, t.info.vocab_size, index=index(), lookup_max=lmax) if sc.ngram else d
    kind = f"draft-eagle3+{sc.lookup}" if sc.ngram else "draft-eagle3"
    return Speculator(drafter_factory=make, spec_type=kind, p_min=None, schedule=False, num_draft_tokens=n,
                      description=f"eagle3{'+' + sc.lookup if sc.ngram else ''} {Path(draft).name} chain={n}"
                                  + (f" lookup<={max(lmax, n)}" if sc.ngram and lmax else ""), policy=policy,
                      suffix=_shared_suffix(sc) if sc.ngram else None)


def as_target(model) -> Target:
    if isinstance(model, Target):
        return model
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        args = getattr(model, "args", None)
        # multimodal wrappers (qwen3_5, gemma3) keep the text model's fields in args.text_config
        text = getattr(args, "text_config", None)
        text = text if isinstance(text, dict) else {}
        hidden = getattr(args, "hidden_size", None) or text.get("hidden_size")
        if hidden is None:
            raise MlxspecError("cannot wrap this model: it has no .args with hidden_size")
        cfg = {"hidden_size": hidden, "model_type": getattr(args, "model_type", "")}
        cfg.update({k: getattr(args, k, text.get(k)) for k in ("num_attention_heads", "num_key_value_heads",
                    "head_dim", "rope_theta", "rms_norm_eps") if hasattr(args, k) or k in text})
        return Target(model, cfg)
    raise MlxspecError(f"cannot use {type(model).__name__} as a target: expected an mlx-lm model or mlxspec Target")


def _eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eid = getattr(tokenizer, "eos_token_id", None)
        ids = {eid} if eid is not None else set()
    return set(ids)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A string prompt -> ids as mlx-lm's `stream_generate` encodes it: with the tokenizer's
    special tokens (BOS where the vocabulary adds one) unless the text already starts with BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def stream_generate(
    model,
    tokenizer,
    prompt: str | list[int],
    speculator: Speculator | None = None,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    stop: list[str] | None = None,
    drafter=None,
    cache: list | None = None,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per token (stats accumulate as it goes).

    drafter: use this drafter instead of a new one from the speculator; cache: a target
    cache holding a prefix of the prompt to continue (see `generate_steps`; mlxspec serve's
    prompt cache).
    """
    check_sampling_args(max_tokens, temp, top_p, top_k, seed)
    if stop is not None and (isinstance(stop, str) or not all(isinstance(x, str) for x in stop)):
        raise MlxspecError(f"stop {stop!r}: pass a list of strings")
    for s in stop or []:
        check_text("stop", s)
    if isinstance(prompt, str):
        check_text("prompt", prompt)
    target = as_target(model)
    spec = speculator or Speculator()
    ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise MlxspecError("the prompt is empty; pass some text with --prompt")
    ids = check_prompt_ids(ids, target.info.vocab_size, target.config.get("max_position_embeddings"), max_tokens)
    stats = SpecStats()
    sp = SamplingParams(temp, top_p, top_k)
    detok = tokenizer.detokenizer
    detok.reset()
    eos = _eos_ids(tokenizer)
    text_so_far, sent, emitted = "", 0, 0  # with stop strings: text seen / already yielded
    stop = [s for s in (stop or []) if s]
    mx.reset_peak_memory()
    steps = spec.session(target, ids, max_tokens=max_tokens, sampling=sp, seed=seed, eos_ids=eos, stats=stats,
                         cache=cache, drafter=drafter)
    finished = False
    for committed in steps:
        for j, tok in enumerate(committed):
            emitted += 1
            finish = None
            if tok in eos:
                finish = "stop"
            elif emitted >= max_tokens:
                finish = "length"
            if tok not in eos:
                detok.add_token(tok)
            if finish:
                detok.finalize()
            seg = detok.last_segment
            if stop:
                text_so_far += seg
                hit = min((text_so_far.find(s) for s in stop if s in text_so_far), default=-1)
                if hit >= 0:
                    finish, end = "stop", hit
                elif finish:
                    end = len(text_so_far)
                else:  # hold back a tail that may be the start of a stop string
                    end = len(text_so_far) - max(
                        (k for s in stop for k in range(1, len(s)) if text_so_far.endswith(s[:k])), default=0)
                seg = text_so_far[sent:end]
                sent += len(seg)
            yield GenerationResponse(
                text=seg, token=tok, logprobs=None, from_draft=j < len(committed) - 1,
                prompt_tokens=stats.prompt_tokens, prompt_tps=stats.prompt_tps,
                generation_tokens=emitted, generation_tps=stats.generation_tps,
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish,
                acceptance_rate=stats.acceptance_rate, tau=stats.tau, stats=stats,
            )
            if finish:
                finished = True
                break
        if finished:
            steps.close()
            break


def generate(model, tokenizer, prompt, speculator=None, *, verbose: bool = False, **kw) -> str:
    text, last = "", None
    if verbose:  # as mlx_lm.generate: the text between two rules, then the footer
        print("=" * 10)
    for r in stream_generate(model, tokenizer, prompt, speculator, **kw):
        if verbose:
            print(r.text, end="", flush=True)
        text += r.text
        last = r
    if verbose and last is not None:
        print()
        print(footer(last))
    return text


def footer(r: GenerationResponse) -> str:
    s = r.stats
    lines = [
        "=" * 10,
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
    ]
    if s is not None and s.drafted:
        ppa = " ".join(f"{x:.2f}" for x in s.per_position_acceptance)
        tot = s.draft_time + s.verify_time
        lines.append(
            f"Speculative: acceptance {100 * s.acceptance_rate:.1f}% ({s.accepted}/{s.drafted}), "
            f"tau {s.tau:.2f} tokens/forward, draft {100 * s.draft_time / max(tot, 1e-9):.0f}% / "
            f"verify {100 * s.verify_time / max(tot, 1e-9):.0f}% of step time"
        )
        lines.append(f"Per-position acceptance: {ppa}")
        if s.by_source:
            acc = max(s.accepted, 1)
            lines.append("Accepted by source: " + ", ".join(
                f"{k} {a}/{d} drafts ({100 * a / acc:.0f}% of accepted)" for k, (d, a) in sorted(s.by_source.items())))
    lines.append(f"Peak memory: {r.peak_memory:.3f} GB")
    return "\n".join(lines)


def make_policy(target: Target, drafter, spec: Speculator, temp: float = 0.0) -> LengthPolicy:
    """The verify-length policy of one request (`mlxspec.engine.policy`): adaptive (starting
    from what the speculator's previous request at the same kind of sampling learned) or
    fixed (at most num_draft_tokens), inside --schedule and --p-min."""
    if spec.policy == "adaptive" and drafter.max_drafts > 0:
        key = "greedy" if temp == 0 else f"temp={temp:g}"
        base = spec.memory.policy(key, lambda: VerifyPolicy.from_profile(profile_for(target, drafter), drafter.max_drafts,
                                                                chain=bool(getattr(drafter, "chain", False)),
                                                                stops_early=bool(getattr(drafter, "stops_early", False)),
                                                                model_cap=getattr(drafter, "model_max", None)))
    else:
        base = FixedLength(spec.num_draft_tokens)
    return compose(base, p_min=spec.p_min, schedule=profile_for(target, drafter) if spec.schedule else None)


def profile_for(target: Target, drafter) -> dict[int, float]:
    """Verify steps/second per block length (1 .. max_drafts+1), measured once per model
    and device and cached in the mlxspec cache dir."""
    return verify_profile(target, drafter.max_drafts + 1)
