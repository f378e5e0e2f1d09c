#!/usr/bin/env python
"""Write a trained EAGLE-3 export the way mlxspec ships it: every float tensor in float16 except the
head, which stays the target's exact float32 rows (what the drafter loads anyway), in the
speculators format.

    python scripts/ship_drafter.py runs/e3-c/hf mlxspec/weights/smollm2-135m-eagle3

The target is the default SmolLM2 (--model to name another); the export is read against it, so a
drafter that does not fit the target is refused in one line.
"""

import argparse
import io
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", help="an EAGLE-3 export (mlxspec train's OUT/hf)")
    ap.add_argument("dst", help="where to write the shipped copy (replaced)")
    ap.add_argument("--model", default=None)
    a = ap.parse_args()

    import mlxspec  # noqa: F401 - first: OpenBLAS before MLX
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxspec.drafters.eagle3 import Eagle3Config
    from mlxspec.drafters.load import load_drafter, save_drafter
    from mlxspec.errors import MlxspecError
    from mlxspec.targets.load import load_target

    try:
        target, _ = load_target(a.model)
        model, cfg = load_drafter(a.src, target.info, log=io.StringIO())
        if not isinstance(cfg, Eagle3Config):
            raise MlxspecError(f"{a.src}: a {cfg.lineage} drafter; this script ships EAGLE-3 exports")
        model.load_weights([(k, v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) and k != "lm_head.weight"
                             else v) for k, v in tree_flatten(model.parameters())])
        save_drafter(model, cfg, a.dst, "speculators-eagle3", target=target)
    except MlxspecError as e:
        print(f"ship_drafter.py: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"ship_drafter.py: wrote {a.dst}")


if __name__ == "__main__":
    main()
