"""Converts model checkpoints between Hugging Face and rlscale formats.

    python tools/convert.py --from hf --to rlscale SRC_HF_DIR DST_DIR [--dtype bfloat16]
    python tools/convert.py --from rlscale --to hf SRC_DIR DST_HF_DIR [--family qwen2]

The Hugging Face side is config.json + safetensors (Llama, Qwen2, Qwen3, Gemma), loadable by
transformers and vLLM; the rlscale side is `rlscale.checkpoint.save_params`.
"""

import argparse

from rlscale import checkpoint
from rlscale.model import hf


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src_format", choices=("hf", "rlscale"), required=True)
    p.add_argument("--to", dest="dst_format", choices=("hf", "rlscale"), required=True)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", default=None, help="hf -> rlscale: float32 or bfloat16")
    p.add_argument(
        "--family",
        default=None,
        choices=hf.FAMILIES,
        help="rlscale -> hf: model family (default: inferred from the config)",
    )
    args = p.parse_args()
    if args.src_format == args.dst_format:
        p.error("--from and --to must differ")
    if args.src_format == "hf":
        cfg, _, params = hf.load_hf(args.src, dtype=args.dtype)
        checkpoint.save_params(args.dst, cfg, params)
    else:
        cfg, _, params = checkpoint.load_params(args.src)
        hf.save_hf(args.dst, cfg, params, family=args.family)
    print(
        f"{args.src} ({args.src_format}) -> {args.dst} ({args.dst_format}): "
        f"{cfg.num_params() / 1e6:.2f}M params, {cfg.param_dtype}"
    )


if __name__ == "__main__":
    main()
