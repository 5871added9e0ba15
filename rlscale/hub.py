"""Hugging Face Hub names wherever a checkpoint or a data file is read: `local_path` turns a
config value into a local path once, at start-up (`localize` does a config's keys at once), so
everything after it reads local files. docs/hugging_face.md#checkpoints-and-files-by-hub-name.

A value is, in this order:

* an existing local path: kept as it is;
* `org/name` or `org/name@revision` (a branch, tag or commit), where a key names a checkpoint
  (`REPO`): that model repository's snapshot directory;
* `hf://[models/|datasets/|spaces/]org/name[@revision][/path/in/repo]`, huggingface_hub's own
  URI grammar (`huggingface_hub.parse_hf_uri`, which also reads the huggingface.co web URLs
  copied from a browser), where any key is read: the snapshot directory, or the file or folder
  at `path/in/repo` inside it (`hf://datasets/openai/gsm8k/main/test-00000-of-00001.parquet`);
* anything else: kept as it is, for the key's own checks to report.

Snapshots are fetched by `huggingface_hub.snapshot_download` into its cache (`HF_HUB_CACHE`,
else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and read from there; with `HF_HUB_OFFLINE=1`
(the library's `is_offline_mode`) nothing is fetched and the cache alone answers. A name that
is neither cached nor fetchable is a `HubError` naming the key and the name.
"""

import os

import huggingface_hub
import ml_collections
from absl import logging
from huggingface_hub import constants, errors

# What a key names: a checkpoint (`REPO`: a bare `org/name` is a model repository) or a file
# (`FILE`: only an `hf://` name, since `data/train.jsonl` reads as a relative path).
REPO, FILE = "repo", "file"
# Weight formats rlscale never reads (it reads safetensors and orbax checkpoints), left out
# when a whole model repository is fetched: many repositories ship each format.
UNREAD_WEIGHTS = (
    "*.bin",
    "*.pt",
    "*.pth",
    "*.h5",
    "*.msgpack",
    "*.ckpt",
    "*.onnx",
    "*.onnx_data",
    "*.gguf",
    "*.tflite",
    "*.mlmodel",
    "original/*",
    "onnx/*",
    "openvino/*",
)


# What `snapshot_download` raises for a name it cannot serve (the repository and revision
# errors are `HfHubHTTPError`s; an uncached name offline is a `LocalEntryNotFoundError`, an
# OSError); anything else is a bug and keeps its traceback.
FETCH_ERRORS = (errors.HfHubHTTPError, errors.HFValidationError, OSError)


class HubError(ValueError):
    """A Hub name that does not resolve to a local path, naming the key and the name."""


def parse(value: str, kind: str = REPO) -> huggingface_hub.HfUri | None:
    """The Hub location `value` names (module docstring; `kind`: `REPO` or `FILE`), or None
    when it names none (a local path, or a bare `org/name` where `kind` is `FILE`).

    Raises:
      errors.HfUriError: For an `hf://` name or a huggingface.co URL that does not parse.
    """
    if value.startswith(constants.HF_PROTOCOL) or value.startswith(("https://", "http://")):
        return huggingface_hub.parse_hf_uri(value)
    if kind != REPO or value.startswith(("/", ".", "~")):
        return None
    name = value.split("@", 1)[0]
    if name.count("/") != 1 or any(c.isspace() for c in value):
        return None
    try:
        uri = huggingface_hub.parse_hf_uri(f"{constants.HF_PROTOCOL}models/{value}")
    except errors.HfUriError:  # Not shaped like a repository id: a local path.
        return None
    return uri if not uri.path_in_repo else None


def local_path(value: str | None, key: str, kind: str = REPO) -> str | None:
    """`value` (of config key `key`) as a local path: itself when it exists or names no Hub
    location, else the snapshot directory, file or folder it names (module docstring).

    Raises:
      HubError: Naming `key` and `value` when the name does not parse, or its repository,
        revision or path is neither in the cache nor fetchable.
    """
    if not value or os.path.exists(value):
        return value
    try:
        uri = parse(value, kind)
    except errors.HfUriError as e:
        raise HubError(f"{key}={value!r}: {e}") from None
    if uri is None:
        return value
    if uri.is_bucket:
        raise HubError(f"{key}={value!r}: a bucket is not a repository; name a model or dataset")
    return _fetch(uri, value, key)


def _fetch(uri: huggingface_hub.HfUri, value: str, key: str) -> str:
    """The local path of `uri` (`value` of `key`): its snapshot, downloaded unless cached."""
    where = f"{key}={value!r}"
    path = uri.path_in_repo
    try:
        snapshot = huggingface_hub.snapshot_download(
            uri.id,
            repo_type=uri.type,
            revision=uri.revision,
            allow_patterns=[path, f"{path}/*"] if path else None,
            ignore_patterns=None if path else list(UNREAD_WEIGHTS),
            local_files_only=huggingface_hub.is_offline_mode(),
        )
    except FETCH_ERRORS as e:
        raise HubError(f"{where}: {_reason(e, uri, value)}") from None
    local = os.path.join(snapshot, path) if path else snapshot
    if not os.path.exists(local):
        revision = uri.revision or constants.DEFAULT_REVISION
        cached = " in the Hugging Face cache" if huggingface_hub.is_offline_mode() else ""
        raise HubError(f"{where}: {uri.id}@{revision} has no {path!r}{cached}")
    logging.info("%s: %s", where, local)
    return local


def _reason(e: Exception, uri: huggingface_hub.HfUri, value: str) -> str:
    """What went wrong fetching `uri` (`value`), from huggingface_hub's exception `e`; a bare
    `org/name` might have meant a local path, so the message says there is none."""
    kind = f"{uri.type} repository {uri.id!r}"
    local = "" if "://" in value else "no such local path, and "
    cache = constants.HF_HUB_CACHE
    if isinstance(e, errors.RevisionNotFoundError):
        return f"no revision {uri.revision!r} in the {kind} on the Hugging Face Hub"
    if isinstance(e, errors.GatedRepoError):
        return f"the {kind} is gated: accept its terms on huggingface.co and log in (hf auth login)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"{local}no {kind} on the Hugging Face Hub (a private one needs a login: hf auth "
            "login, or HF_TOKEN)"
        )
    if isinstance(e, errors.IncompleteSnapshotError):
        return f"the cached snapshot of the {kind} is incomplete ({cache}): {_first_line(e)}"
    if isinstance(e, errors.LocalEntryNotFoundError):
        if huggingface_hub.is_offline_mode():
            repo_type = f" --repo-type {uri.type}" if uri.type != "model" else ""
            return (
                f"{local}the {kind} is not in the Hugging Face cache ({cache}) and "
                f"HF_HUB_OFFLINE is set: fetch it once online (hf download {uri.id}{repo_type}), "
                "or unset HF_HUB_OFFLINE"
            )
        return (
            f"{local}the {kind} is not in the Hugging Face cache ({cache}) and the Hub cannot "
            f"be reached: {_first_line(e.__cause__ or e)}"
        )
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def localize(config: ml_collections.ConfigDict, keys: dict[str, str]) -> ml_collections.ConfigDict:
    """A copy of `config` with each of `keys` (dotted key -> `REPO` or `FILE`) that it holds
    replaced by its local path (`local_path`); `config` itself is unchanged.

    Raises:
      HubError: Listing every name that does not resolve (`; `-separated), each naming its
        key.
    """
    local, problems = config.copy_and_resolve_references(), []
    for dotted, kind in keys.items():
        *parents, leaf = dotted.split(".")
        node = local
        for name in parents:
            node = node.get(name) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or not isinstance(node.get(leaf), str):
            continue
        try:
            node[leaf] = local_path(node[leaf], dotted, kind)
        except HubError as e:
            problems.append(str(e))
    if problems:
        raise HubError("; ".join(problems))
    return local
