"""Calibration on a user's own text: documents from a local file or a saved dataset folder (Sec. 6's protocol).

The paper calibrates on ``k`` batches of random ``seq_len``-token windows of a generic corpus
(:func:`fisherkron.hf.data.lm_batches`); any list of documents serves. :func:`load_documents` reads one
from a user's corpus through ``datasets``' own loaders, offline (local files need no hub):

==================================  =============================================================
source                              documents
==================================  =============================================================
``.txt``                            paragraphs: text separated by an empty line (``sample_by="paragraph"``)
``.jsonl`` / ``.json``              the ``text_field`` of each record (JSON Lines, or one JSON array)
``.csv`` / ``.parquet``             the ``text_field`` column
folder (``save_to_disk``)           a ``Dataset``'s ``text_field``; of a ``DatasetDict``, the ``train``
                                    split, or its only split
==================================  =============================================================

``text_field`` defaults to ``"text"``. A separator line of a ``.txt`` must be empty: a line of spaces
belongs to its paragraph. Rows whose text is missing or blank are dropped.

``load_dataset`` always writes Arrow files under its cache (``HF_HOME/datasets`` by default), also with
``keep_in_memory``: here it writes them in a temporary folder removed when the load ends, and keeps the
table in memory, so reading a user's file leaves nothing behind. A saved folder is read in place
(``load_from_disk`` writes nothing).

Bad input is one :class:`~fisherkron.core.errors.FisherkronError` line naming the file, raised before
any calibration; :func:`check_enough_tokens` refuses a corpus too short for ``k`` batches.
"""
from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..core.checks import check_int
from ..core.conventions import FisherkronError
from ..env import set_offline_env
from .data import window_ids

__all__ = ["FILE_TYPES", "load_documents", "count_tokens", "check_enough_tokens", "data_source"]

log = logging.getLogger(__name__)

#: suffix -> (``datasets`` packaged loader, the format as a message names it)
FILE_TYPES: dict[str, tuple[str, str]] = {
    ".txt": ("text", "UTF-8 text"),
    ".jsonl": ("json", "JSON Lines"),
    ".json": ("json", "JSON"),
    ".csv": ("csv", "CSV"),
    ".parquet": ("parquet", "Parquet"),
}
#: what a source may be, as the messages say it
KINDS = ("a .txt (documents separated by blank lines), .jsonl, .json, .csv or .parquet file, "
         "or a folder written by Dataset.save_to_disk")
DEFAULT_FIELD = "text"
_TEXT_TYPES = ("string", "large_string", "string_view")


@contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """``datasets`` without its progress bars (unless ``progress``) and without its own error log line:
    a failure is reported once, by the caller's one-line error."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars_off = datasets.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    if not progress:
        datasets.disable_progress_bars()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if not progress and not bars_off:
            datasets.enable_progress_bars()


def _reason(exc: BaseException) -> str:
    """The parser's own complaint, first line: the first error in the chain that is not ``datasets``' wrapper."""
    from datasets.exceptions import DatasetGenerationError

    seen, e = set(), exc
    while isinstance(e, DatasetGenerationError) and (e.__cause__ or e.__context__) and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = (str(e).strip().splitlines() or [""])[0]
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _load_file(path: Path, src: str, loader: str, what: str, progress: bool):
    """The file as one in-memory :class:`datasets.Dataset`, its Arrow cache in a temporary folder."""
    import datasets

    options = {"sample_by": "paragraph"} if loader == "text" else {}
    with tempfile.TemporaryDirectory(prefix="fisherkron-data-") as cache, _quiet(progress):
        try:
            # data_files is a glob pattern: escaped, "notes [draft].txt" is that file, not a character class
            return datasets.load_dataset(loader, data_files=glob.escape(str(path)), split="train", cache_dir=cache,
                                         keep_in_memory=True, **options)
        except Exception as e:  # noqa: BLE001 -- any parser's failure becomes the one line below
            raise FisherkronError(f"cannot read {src} as {what}: {_reason(e)}") from e


def _load_folder(path: Path, src: str):
    """The ``Dataset`` saved in ``path``; of a ``DatasetDict``, its ``train`` split or its only split."""
    import datasets

    if not any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        raise FisherkronError(f"{src} is a folder but not one written by Dataset.save_to_disk or "
                              f"DatasetDict.save_to_disk (it has no state.json or dataset_dict.json); give such "
                              f"a folder, or a .txt, .jsonl, .json, .csv or .parquet file")
    with _quiet(progress=False):
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001
            raise FisherkronError(f"cannot read {src} as a saved dataset: {_reason(e)}") from e
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" in ds:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise FisherkronError(f"{src} holds the splits {', '.join(splits)} and none is 'train': save the split "
                                  f"to calibrate on alone (dataset_dict[split].save_to_disk) or name it 'train'")
        log.info("%s is a DatasetDict of the splits %s: documents come from %r", src, ", ".join(splits), split)
        ds = ds[split]
    return ds


def _field(ds, src: str, text_field: str | None) -> str:
    """The column that holds the documents: ``text_field``, by default ``"text"``; it must hold strings."""
    features = ds.features
    textual = [c for c, f in features.items() if getattr(f, "dtype", None) in _TEXT_TYPES]
    holding = f"fields holding text: {', '.join(textual)}" if textual else "no field holds text"
    field = DEFAULT_FIELD if text_field is None else text_field
    if field not in features:
        default = " (the default)" if text_field is None else ""
        raise FisherkronError(f"{src} has no field {field!r}{default}; its fields are {', '.join(features) or 'none'} "
                              f"({holding}): name the field with text_field= (--text-field on the command line)")
    if field not in textual:
        kind = getattr(features[field], "dtype", None) or type(features[field]).__name__
        raise FisherkronError(f"{src}: field {field!r} holds {kind}, not text ({holding})")
    return field


def load_documents(source: str | os.PathLike, *, text_field: str | None = None,
                   progress: bool = False) -> list[str]:
    """The documents of a user's corpus, for :func:`~fisherkron.hf.data.lm_batches` (Sec. 6's calibration).

    Args:
        source: a ``.txt``, ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file, or a folder written by
            ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (see the module's table).
        text_field: the field or column that holds the text (default ``"text"``); not for a ``.txt``.
        progress: show ``datasets``' progress bar while a file is converted.

    Returns:
        The non-blank documents, in the file's order (a ``.txt`` paragraph without its surrounding newlines).

    Raises:
        FisherkronError: one line naming ``source``: missing, empty, of an unsupported type, unreadable by
            its parser, without the field, with a field that is not text, or without a non-blank document.

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     p = pathlib.Path(folder, "notes.txt")
    ...     _ = p.write_text("First paragraph,\\nstill the first.\\n\\nSecond.\\n")
    ...     load_documents(p)
    ['First paragraph,\\nstill the first.', 'Second.']
    """
    set_offline_env()  # defaults only: a local file needs no hub
    src = os.fspath(source)
    path = Path(src).expanduser()
    if not path.exists():
        raise FisherkronError(f"no file or folder at {src}: check the path (calibration text is {KINDS})")
    plain = path.is_file() and path.suffix.lower() == ".txt"  # documents are paragraphs; no fields
    if path.is_dir():
        ds = _load_folder(path, src)
    else:
        suffix = path.suffix.lower()
        if suffix not in FILE_TYPES:
            raise FisherkronError(f"{src} is not a file type fisherkron reads ({suffix or 'no extension'}); "
                                  f"give {KINDS}")
        if plain and text_field is not None:
            raise FisherkronError(f"{src} is plain text, whose documents are its paragraphs: it has no field "
                                  f"{text_field!r} (text_field is for .jsonl, .json, .csv, .parquet and folders)")
        if path.stat().st_size == 0:
            raise FisherkronError(f"{src} is empty: it holds no documents to calibrate on")
        ds = _load_file(path, src, *FILE_TYPES[suffix], progress)
    field = DEFAULT_FIELD if plain else _field(ds, src, text_field)
    column = ds[field][:]  # (rows,) str or None
    documents = [d.strip("\n") if plain else d for d in column if d is not None and d.strip()]
    if not documents:
        rows = "paragraphs" if plain else f"rows of field {field!r}"
        raise FisherkronError(f"{src} holds no non-empty documents ({len(column)} {rows}, all blank or missing)")
    log.debug("%s: %d documents", src, len(documents))
    return documents


def count_tokens(tokenizer, documents: Sequence[str], need: int) -> int:
    """The tokens ``documents`` give as :func:`~fisherkron.hf.data.lm_batches` joins them (each
    document's tokens, then an EOS), counted until there are ``need`` (so at most a little more)."""
    eos = 0 if tokenizer.eos_token_id is None else 1
    have = 0
    for doc in documents:
        have += len(window_ids(tokenizer, doc)) + eos
        if have >= need:
            break
    return have


def check_enough_tokens(tokenizer, documents: Sequence[str] | str, k: int, batch_size: int, seq_len: int, *,
                        source: str | os.PathLike | None = None) -> int:
    """Refuse documents too short for ``k`` batches of ``batch_size`` windows of ``seq_len`` tokens.

    :func:`~fisherkron.hf.data.lm_batches` joins the documents' tokens, an EOS after each, and cuts
    ``N // seq_len`` windows of the ``N`` tokens; it needs ``N >= k * batch_size * seq_len``. Tokens are
    counted as it counts them (:func:`~fisherkron.hf.data.window_ids`), stopping once there are enough, so
    this passes exactly when ``lm_batches`` can draw its batches.

    Returns:
        The tokens counted: at least ``k * batch_size * seq_len``.

    Raises:
        FisherkronError: one line with the tokens needed and the tokens the documents give.
    """
    check_int(k, "k", minimum=1), check_int(batch_size, "batch_size", minimum=1)
    check_int(seq_len, "seq_len", minimum=2)
    if isinstance(documents, str):
        documents = [documents]
    need = k * batch_size * seq_len
    have = count_tokens(tokenizer, documents, need)
    if have >= need:
        return have
    where = "" if source is None else f"{os.fspath(source)}: "
    raise FisherkronError(f"{where}{len(documents)} documents give {have} tokens, but k x batch_size x seq_len = "
                          f"{k} x {batch_size} x {seq_len} = {need} are needed: lower k, batch_size or seq_len, "
                          f"or give more text")


def data_source(value: str, names: Sequence[str]) -> str | Path:
    """What a ``--data`` value names: ``value`` itself when it is one of the built-in sets ``names``;
    otherwise the path of an existing file or folder.

    A built-in name wins over a file of that name in the working directory (write ``./c4`` for the file).

    >>> data_source("c4", ("c4", "sst2")), str(data_source(".", ("c4", "sst2")))
    ('c4', '.')
    """
    if value in names:
        return value
    path = Path(value).expanduser()
    if path.exists():
        return path
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if not value.startswith((".", "~")) and not any(s in value for s in seps) and not Path(value).suffix:
        raise FisherkronError(f"{value!r} is neither a built-in data set ({', '.join(names)}) nor a file or folder "
                              f"here; for your own text give {KINDS}")
    raise FisherkronError(f"no file or folder at {value}: check the path (calibration text is {KINDS})")
