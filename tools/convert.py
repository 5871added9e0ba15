"""Converts model checkpoints between Hugging Face and rlscale formats.

    python tools/convert.py --from hf --to rlscale SRC_HF_DIR DST_DIR [--dtype bfloat16]
    python tools/convert.py --from rlscale --to hf SRC_DIR DST_HF_DIR [--family qwen2]
        [--tokenizer PATH] [--stop_tokens 151645,151643]

The Hugging Face side is config.json + safetensors (Llama, Qwen2, Qwen3, Gemma), loadable by
transformers and vLLM; the rlscale side is `rlscale.checkpoint.save_params`. The tokenizer
travels with the weights: rlscale -> hf writes the checkpoint's tokenizer (its own files, or
its run's `WORKDIR/tokenizer.model`, or --tokenizer) with its bos/eos/pad ids, stopping at
--stop_tokens (default: the EOS), so the export serves as rlscale samples; hf -> rlscale
copies the directory's tokenizer into the rlscale checkpoint, where `rlscale.evaluate` finds it.
"""

import os

from rlscale import checkpoint, cli, saved_policy
from rlscale import tokenizer as tokenizer_lib
from rlscale.model import hf


def _source_tokenizer(args):
    """The tokenizer to carry over, or None when the source has none."""
    if args.tokenizer:
        return tokenizer_lib.load(args.tokenizer)
    if args.src_format == "hf":
        try:
            return tokenizer_lib.load(args.src)
        except FileNotFoundError:
            return None
    workdir = os.path.dirname(os.path.abspath(args.src))  # A run's WORKDIR/final or /sft.
    try:
        return tokenizer_lib.load(saved_policy.default_tokenizer_path(args.src, workdir))
    except FileNotFoundError:
        return None


def main():
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to write with the checkpoint (default: the source's, if it has one)",
    )
    p.add_argument(
        "--stop_tokens",
        default=None,
        help="rlscale -> hf: comma-separated ids generation stops at (default: the EOS)",
    )
    args = p.parse_args()
    if args.src_format == args.dst_format:
        p.error("--from and --to must differ")
    tok = _source_tokenizer(args)
    stop = None
    if args.stop_tokens:
        stop = [int(t) for t in args.stop_tokens.split(",")]
    try:
        if args.src_format == "hf":
            cfg, _, params = hf.load_hf(args.src, dtype=args.dtype)
            hf_tok = tok.to_hf() if tok is not None else None  # Fails before anything is written.
            checkpoint.save_params(args.dst, cfg, params)
            if hf_tok is not None:
                hf_tok.save(args.dst)
        else:
            cfg, _, params = checkpoint.load_params(args.src)
            hf.save_hf(args.dst, cfg, params, family=args.family, tokenizer=tok, stop_tokens=stop)
    except ValueError as e:  # An unsupported model or tokenizer: the message names it.
        p.error(str(e))
    print(
        f"{args.src} ({args.src_format}) -> {args.dst} ({args.dst_format}): "
        f"{cfg.num_params() / 1e6:.2f}M params, {cfg.param_dtype}, "
        + (f"tokenizer {tok!r}" if tok is not None else "no tokenizer")
    )


if __name__ == "__main__":
    cli.guard(main)()
