"""Checkpoint paths in configuration files (engine.json, the vLLM backend's model.json).

- A relative path is relative to the file that names it.
- ``$VARIABLE`` / ``${VARIABLE}`` are expanded from the environment; an unset one is refused by
  name. ``$NIGHTDRAFT_ROOT`` is always defined: the directory that holds the ``backend``
  package (a source checkout, ``/opt/nightdraft`` in the image) unless the environment sets it,
  so a model folder can name the bundled checkpoints wherever the folder is copied.
- A Hugging Face model id (``org/name``, what vLLM's ``model`` usually holds) that is not a local
  directory is looked up in the local Hugging Face cache (``$HF_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; the layout ``huggingface-cli download``
  writes). nightdraft never downloads: a model that is not on disk is refused with a message
  saying where it was looked for.
"""
from __future__ import annotations

import os
import re
import string
from pathlib import Path

from backend.errors import ConfigError

ROOT_VARIABLE = "NIGHTDRAFT_ROOT"
# org/name as the Hugging Face Hub spells repository ids (letters, digits, - _ .).
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def nightdraft_root() -> Path:
    """``$NIGHTDRAFT_ROOT``, else the directory holding the ``backend`` package."""
    env = os.environ.get(ROOT_VARIABLE)
    if env:
        return Path(env)
    import backend
    return Path(backend.__file__).resolve().parent.parent


def expand(key: str, value: str) -> str:
    """``value`` with environment variables expanded (``$NIGHTDRAFT_ROOT`` always defined)."""
    if "$" not in value:
        return value
    env = {ROOT_VARIABLE: str(nightdraft_root()), **os.environ}
    try:
        return string.Template(value).substitute(env)
    except KeyError as e:
        raise ConfigError(f"{key}: {value!r} names ${e.args[0]}, which is not set in the server's "
                          "environment") from None
    except ValueError:
        raise ConfigError(f"{key}: {value!r} has a '$' that is not a variable (write $$ for a "
                          "literal '$')") from None


def resolve_local(key: str, value: str, base_dir: str | Path | None) -> Path:
    """A path from a configuration file: variables expanded, relative to ``base_dir``."""
    path = Path(expand(key, value)).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path.resolve()


def hf_hub_cache() -> Path:
    """The Hugging Face cache the Hub's own tools use (honours HF_HUB_CACHE and HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_checkpoint(key: str, value: str, base_dir: str | Path | None, *, revision: str | None = None,
                       cache_dirs: tuple[str | Path, ...] = ()) -> Path:
    """A checkpoint directory: a local path (see :func:`resolve_local`), else a Hugging Face id
    found in the local cache (``cache_dirs`` first, e.g. vLLM's ``download_dir``, then the Hub's
    cache) at ``revision`` (default ``main``). Refused with a message saying where it looked."""
    local = resolve_local(key, value, base_dir)
    if local.is_dir() or not _HF_ID.fullmatch(value):
        return local
    caches = [Path(expand(key, str(c))).expanduser() for c in cache_dirs] + [hf_hub_cache()]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    for cache in caches:
        try:
            return Path(snapshot_download(value, revision=revision, cache_dir=str(cache),
                                          local_files_only=True))
        except LocalEntryNotFoundError:
            continue
    where = ", ".join(str(c / ("models--" + value.replace("/", "--"))) for c in caches)
    raise ConfigError(
        f"{key}: {value!r} is not a local directory ({local}) and not in the Hugging Face cache "
        f"({where}{', revision ' + revision if revision else ''}). nightdraft never downloads: "
        f"fetch it where there is network (huggingface-cli download {value}) into that cache, "
        "and mount it (HF_HOME or HF_HUB_CACHE name it), or name a local checkout directory")
