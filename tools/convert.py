"""Converts model checkpoints between Hugging Face and rlscale formats.

    python tools/convert.py --from hf --to rlscale SRC_HF_DIR_OR_HUB_NAME DST_DIR [--dtype bfloat16]
    python tools/convert.py --from rlscale --to hf SRC_DIR DST_HF_DIR [--family qwen2]
        [--tokenizer PATH] [--stop_tokens 151645,151643]

The Hugging Face side is config.json + safetensors (Llama, Qwen2, Qwen3, Gemma), loadable by
transformers and vLLM; the rlscale side is `rlscale.checkpoint.save_params`. The tokenizer
travels with the weights: rlscale -> hf writes the checkpoint's tokenizer (its own files, or
its run's `WORKDIR/tokenizer.model`, or --tokenizer) with its bos/eos/pad ids, stopping at
--stop_tokens (default: the EOS), so the export serves as rlscale samples; hf -> rlscale
copies the directory's tokenizer into the rlscale checkpoint, where `rlscale.main.evaluate` finds
it.
"""

import os

from absl import flags

from rlscale import checkpoint, cli, hub, saved_policy
from rlscale import tokenizers as tokenizer_lib
from rlscale.model import hf

FORMATS = ["hf", "rlscale"]


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_enum("from", None, FORMATS, "the format of SRC", flag_values=fv)
    flags.DEFINE_enum("to", None, FORMATS, "the format of DST", flag_values=fv)
    for name in ("from", "to"):
        flags.mark_flag_as_required(name, flag_values=fv)
    flags.DEFINE_string("dtype", None, "hf -> rlscale: float32 or bfloat16", flag_values=fv)
    flags.DEFINE_enum(
        "family",
        None,
        list(hf.FAMILIES),
        "rlscale -> hf: model family (default: inferred from the config)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "tokenizer to write with the checkpoint (default: the source's, if it has one)",
        flag_values=fv,
    )
    flags.DEFINE_list(
        "stop_tokens",
        None,
        "rlscale -> hf: comma-separated ids generation stops at (default: the EOS)",
        flag_values=fv,
    )


def _source_tokenizer(src: str, src_format: str, tokenizer: str | None):
    """The tokenizer to carry over, or None when the source has none."""
    if tokenizer:
        return tokenizer_lib.load(tokenizer)
    if src_format == "hf":
        try:
            return tokenizer_lib.load(src)
        except FileNotFoundError:
            return None
    workdir = os.path.dirname(os.path.abspath(src))  # A run's WORKDIR/final or /sft.
    try:
        return tokenizer_lib.load(saved_policy.default_tokenizer_path(src, workdir))
    except FileNotFoundError:
        return None


def main(fv: flags.FlagValues, args) -> None:
    """Converts SRC to DST (the positional `args`).

    Raises:
      ValueError: bad arguments, or a model or tokenizer the conversion does not support.
    """
    if len(args) != 2:
        raise ValueError(f"expected SRC and DST, got {len(args)} argument(s): {' '.join(args)}")
    src, dst = args
    src_format, dst_format = fv["from"].value, fv["to"].value
    if src_format == dst_format:
        raise ValueError("--from and --to must differ")
    if src_format == "hf":  # A Hub name (`org/name[@revision]`) too: rlscale.hub.
        src = hub.local_path(src, "SRC")
    tok = _source_tokenizer(src, src_format, fv.tokenizer)
    stop = None
    if fv.stop_tokens:
        stop = [int(t) for t in fv.stop_tokens]
    try:
        if src_format == "hf":
            cfg, _, params = hf.load_hf(src, dtype=fv.dtype)
            hf_tok = tok.to_hf() if tok is not None else None  # Fails before anything is written.
            checkpoint.save_params(dst, cfg, params)
            if hf_tok is not None:
                hf_tok.save(dst)
        else:
            cfg, _, params = checkpoint.load_params(src)
            hf.save_hf(dst, cfg, params, family=fv.family, tokenizer=tok, stop_tokens=stop)
    except ValueError as e:  # An unsupported model or tokenizer: the message names it.
        raise ValueError(str(e)) from e  # Raised here: the command's own, one `error:` line.
    print(
        f"{src} ({src_format}) -> {dst} ({dst_format}): "
        f"{cfg.num_params() / 1e6:.2f}M params, {cfg.param_dtype}, "
        + (f"tokenizer {tok!r}" if tok is not None else "no tokenizer")
    )


if __name__ == "__main__":
    cli.run_command(define_flags, main)
