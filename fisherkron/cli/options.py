"""What the subcommands share: checked option types, the device, ``--out`` checks, what a model is.

Everything here runs before any model is loaded or any data is read, so a bad value is
reported in one line within a second, not after minutes of calibration.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..core.conventions import FisherkronError

log = logging.getLogger("fisherkron.cli")

__all__ = [
    "CLASSIFICATION_DATA",
    "TASKS",
    "ModelInfo",
    "check_device",
    "check_folder",
    "check_out_file",
    "check_out_folder",
    "check_gradient_options",
    "describe_model",
    "DTYPES",
    "input_dtype",
    "stored_dtype",
    "device",
    "disk_size",
    "max_positions",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "ratio",
    "resolve_seq_len",
    "seq_len",
    "tol",
]

TASKS = ("causal-lm", "sequence-classification")
#: what ``--dtype`` accepts: the dtype a save writes its weights in (``auto``: the input model's)
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: classification tasks with an embedded train split (calibration data of a classifier)
CLASSIFICATION_DATA = ("sst2", "boolq", "trec")
#: encoder-only model types: without a task head they load as sequence classifiers
ENCODER_TYPES = frozenset({"bert", "roberta", "distilbert", "electra", "albert", "deberta", "deberta-v2",
                           "xlm-roberta", "mpnet", "camembert", "modernbert"})


# ----------------------------------------------------------------------------- argparse types

def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _number(text, int, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    v = _number(text, int, "a non-negative integer")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def seq_len(text: str) -> int:
    """A sequence length: an integer >= 2 (a causal LM scores nothing in a 1-token window)."""
    v = _number(text, int, "an integer >= 2")
    if v < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _number(text, float, "a finite number > 0")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    v = _number(text, float, "a finite number >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _open_unit(text: str, what: str) -> float:
    v = _number(text, float, f"{what} strictly between 0 and 1")
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected {what} strictly between 0 and 1, got {text!r}")
    return v


def ratio(text: str) -> float:
    """A compression ratio in (0, 1)."""
    return _open_unit(text, "a ratio")


def tol(text: str) -> float:
    """A relative tolerance in (0, 1)."""
    return _open_unit(text, "a tolerance")


def disk_size(text: str) -> int:
    """A disk size in bytes, from ``20GB``, ``1.5TB``, ``500MiB`` or a number of bytes
    (:func:`fisherkron.hf.calibration.disk.parse_size`)."""
    from ..hf.calibration.disk import parse_size

    try:
        return parse_size(text)
    except FisherkronError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_DEVICE = re.compile(r"(cpu|mps|cuda)(?::(\d+))?")


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, and only one this machine has."""
    try:
        return check_device(text)
    except FisherkronError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_device(text: str) -> str:
    """The device string, normalised, or a one-line error when it is malformed or absent here."""
    import torch

    m = _DEVICE.fullmatch(text.strip().lower())
    if m is None or (m.group(1) != "cuda" and m.group(2) is not None):
        raise FisherkronError(f"unknown device {text!r}; use cpu, cuda, cuda:N or mps")
    kind, index = m.group(1), m.group(2)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise FisherkronError(f"device {text!r} was asked for but CUDA is not available "
                                  f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu")
        if index is not None and int(index) >= torch.cuda.device_count():
            raise FisherkronError(f"device {text!r} does not exist: this machine has "
                                  f"{torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise FisherkronError(f"device {text!r} was asked for but MPS is not available; use --device cpu")
    return kind if index is None else f"{kind}:{index}"


# ----------------------------------------------------------------------------- output paths

def _writable(path: Path) -> None:
    """One-line error unless the nearest existing ancestor of ``path`` is a writable folder."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise FisherkronError(f"cannot create {path}: {p} is a file, not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise FisherkronError(f"cannot write to {path}: {p} is not writable")


def check_out_folder(out: str | os.PathLike, *, overwrite: bool, overwrite_edited: bool = False) -> Path:
    """Refuse, up front, an ``--out`` folder the save would refuse or that would lose someone's files.

    The rules are :func:`fisherkron.hf.saving.check_destination`'s (a new or empty folder; an
    earlier fisherkron save only with ``overwrite``, and none of its files edited since unless
    ``overwrite_edited``; nothing else), plus: the folder can be created.
    """
    from ..hf.saving import check_destination

    out = check_destination(out, overwrite=overwrite or overwrite_edited, overwrite_edited=overwrite_edited)
    _writable(out)
    return out


def check_folder(path: str | os.PathLike, option: str) -> Path:
    """A folder the command will write into (existing or to be created): one-line error if it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FisherkronError(f"{option} {path} is a file; give a folder")
    _writable(path)
    return path


def check_out_file(out: str | os.PathLike, *, overwrite: bool) -> Path:
    """Refuse an ``--out`` file that is a folder, or that exists without ``overwrite``."""
    out = Path(out)
    if out.is_dir():
        raise FisherkronError(f"--out {out} is a folder; give a file name")
    if out.exists() and not overwrite:
        raise FisherkronError(f"{out} exists; pass --overwrite to replace it")
    _writable(out)
    return out


# ----------------------------------------------------------------------------- options that cannot go together

def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when started without it, or when it is not an integer:
    :func:`fisherkron.cli.main` refuses that before any command runs)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def check_gradient_options(args, kronecker: bool) -> None:
    """Refuse ``compress`` options that cannot go together, before the model is loaded.

    * ``--granularity token`` stores each layer's inputs ``X`` and output gradients ``D`` in
      float32 and no ``n x m`` gradient, so no ``--grad-dtype`` applies (the library refuses the
      pair too, but only once the model and the data are loaded);
    * under torchrun (``WORLD_SIZE > 1``) the calibration writes float32 per-batch gradients into
      one shared file (:func:`fisherkron.collect_calibration` with ``group=``), so
      ``--grad-dtype`` other than float32, ``--granularity token`` and ``--max-disk`` (which collects
      the layers in groups, one process) are single-process options;
      and ``--mff-parallel`` spreads MFF, which a method without MFF (``kronecker`` False) never runs.
    """
    if args.granularity == "token" and args.grad_dtype != "float32":
        raise FisherkronError(f"--granularity token keeps each layer's inputs and output gradients in float32 "
                              f"and stores no per-batch gradient; drop --grad-dtype {args.grad_dtype}")
    world = torchrun_world_size()
    if world <= 1:
        return
    single = [opt for opt, given in (("--grad-dtype " + args.grad_dtype, args.grad_dtype != "float32"),
                                     ("--granularity token", args.granularity == "token"),
                                     ("--max-disk", getattr(args, "max_disk", None) is not None)) if given]
    if single:
        raise FisherkronError(f"{' and '.join(single)} run in one process only: under torchrun (WORLD_SIZE={world}) "
                              f"the ranks write float32 per-batch gradients into one shared file; drop "
                              f"{'them' if len(single) > 1 else 'it'} or start without torchrun")
    if args.mff_parallel is not None and not kronecker:
        raise FisherkronError(f"--mff-parallel spreads MFF over the ranks, and method {args.method} does not run "
                              f"MFF; drop --mff-parallel")


# ----------------------------------------------------------------------------- what a model is

@dataclass(frozen=True)
class ModelInfo:
    """What is known about a model argument before loading it.

    Attributes:
        name: the argument as given.
        source: ``"embedded"``, ``"folder"`` (a Hugging Face folder), ``"compressed"``
            (a folder written by ``save_compressed``) or ``"hub"``.
        task: the detected task, ``"causal-lm"`` or ``"sequence-classification"``.
        head_labels: number of labels of a trained classification head in the folder, else ``None``.
        architecture: the first entry of ``architectures`` in ``config.json`` (folders only).
        factorised: a ``save_compressed`` folder with ``LowRankLinear`` layers (plain
            transformers cannot load it; :func:`fisherkron.load_compressed` can).
    """

    name: str
    source: str
    task: str
    head_labels: int | None = None
    architecture: str | None = None
    factorised: bool = False


def _task_of_config(cfg: dict) -> tuple[str, int | None]:
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = cfg.get("id2label")
        n = len(labels) if isinstance(labels, dict) and labels else int(cfg.get("num_labels") or 2)
        return "sequence-classification", n
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm", None
    if cfg.get("model_type") in ENCODER_TYPES:
        return "sequence-classification", None
    return "causal-lm", None


def describe_model(name: str) -> ModelInfo:
    """Classify a model argument (embedded alias, local folder, hub name) from its ``config.json`` only.

    Raises a one-line error for a path that is missing, a file, or a folder without ``config.json``.
    """
    from ..env import hub_offline, set_offline_env
    from ..hf.registry import EMBEDDED_MODELS, PAPER_MODELS
    from ..hf.saving import MANIFEST, MODEL_TYPE

    key = name.strip().lower()
    for spec in EMBEDDED_MODELS.values():
        if key in spec.aliases:
            return ModelInfo(name, "embedded",
                             "sequence-classification" if spec.role == "encoder" else "causal-lm")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FisherkronError(f"{name} is a file; give a model folder or an embedded model ('smollm2' or 'minilm')")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FisherkronError(f"{name} has no config.json; it is not a Hugging Face model folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as err:
            raise FisherkronError(f"{cfg_file} is unreadable: {err}") from None
        if not isinstance(cfg, dict):
            raise FisherkronError(f"{cfg_file} does not hold a JSON object")
        task, labels = _task_of_config(cfg)
        arch = (cfg.get("architectures") or [None])[0]
        source = "compressed" if (path / MANIFEST).exists() else "folder"
        return ModelInfo(name, source, task, labels, arch, factorised=cfg.get("model_type") == MODEL_TYPE)
    from ..hf.registry import local_model_path  # the one rule for "is this name a path?", as load_model's

    if local_model_path(name) is not None:
        raise FisherkronError(f"no model folder at {name} ({local_model_path(name).resolve()} does not exist): "
                              "check the path, or name an embedded model ('smollm2' or 'minilm')")
    alt = PAPER_MODELS.get(name)
    task, labels, arch = ("sequence-classification" if alt == "minilm" else "causal-lm"), None, None
    set_offline_env()  # as load_model does: the hub is used only where the user switched it on
    if not hub_offline():
        try:  # a few kB: the task from the config, as for a local folder
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(name).to_dict()
            task, labels = _task_of_config(cfg)
            arch = (cfg.get("architectures") or [None])[0]
        except (OSError, ValueError) as err:  # load_model reports the failure in full
            log.debug("config of %s not read from the hub: %s", name, err)
    return ModelInfo(name, "hub", task, labels, arch)


def max_positions(model) -> int | None:
    """``config.max_position_embeddings`` of a model, when it has one."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def resolve_seq_len(model, given: int | None, default: int, name: str, option: str = "--seq-len") -> int:
    """``given`` (an error naming ``option`` when the model has fewer positions) or ``min(default, positions)``."""
    limit = max_positions(model)
    if given is None:
        return default if limit is None else min(default, limit)
    if limit is not None and given > limit:
        raise FisherkronError(f"{option} {given} exceeds the {limit} positions of {name} "
                              f"(max_position_embeddings); use {option} {limit} or less")
    return given


def load_model(api, args, settings: dict):
    """``(model, tokenizer)`` of ``args.model`` as the task settings say, on ``args.device``."""
    if settings.get("info") is not None and settings["info"].source == "compressed":
        model, tok = api.load_compressed(args.model, return_tokenizer=True)
    else:
        kw = {"task": settings["task"]}
        if settings["num_labels"] is not None:
            kw["num_labels"] = settings["num_labels"]
        model, tok = api.load_model(args.model, **kw)
    if args.device is not None:
        model.to(args.device)
    return model, tok


# ----------------------------------------------------------------------------- the dtype of a model's files

#: safetensors' names of the floating-point dtypes a model folder holds
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(folder: str | os.PathLike) -> str | None:
    """The floating-point dtype most of a model folder's stored weights have (by bytes), or ``None``.

    Read from the headers of its ``*.safetensors`` files (a few kB each); a folder without them
    (``pytorch_model.bin``) answers with its ``config.json``'s ``dtype`` (``torch_dtype``).
    """
    folder = Path(folder)
    size: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 1 << 28)))
        except (OSError, ValueError, struct.error):
            continue
        for name, spec in header.items() if isinstance(header, dict) else ():
            if name != "__metadata__" and isinstance(spec, dict) and spec.get("dtype") in _SAFETENSORS_DTYPES:
                lo, hi = (spec.get("data_offsets") or [0, 0])[:2]
                key = _SAFETENSORS_DTYPES[spec["dtype"]]
                size[key] = size.get(key, 0) + int(hi) - int(lo)
    if size:
        return max(size, key=size.get)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("dtype") or cfg.get("torch_dtype") if isinstance(cfg, dict) else None
    value = str(value).removeprefix("torch.") if value else None
    return value if value in _SAFETENSORS_DTYPES.values() else None


def input_dtype(model, name: str) -> str | None:
    """The dtype the model ``name`` is stored in (``"bfloat16"``, ...), whatever dtype it was loaded in; ``None``
    when it cannot be told.

    A folder (the argument, or the one the model was loaded from: an embedded model's) is read
    by :func:`stored_dtype`; a hub name by its config (``dtype`` / ``torch_dtype``).
    """
    for where in (name, getattr(model, "name_or_path", None),
                  getattr(getattr(model, "config", None), "_name_or_path", None)):
        if where and Path(str(where)).expanduser().is_dir():
            return stored_dtype(Path(str(where)).expanduser())
    hub = getattr(model, "name_or_path", None) or name
    try:
        from transformers import AutoConfig

        value = getattr(AutoConfig.from_pretrained(hub), "dtype", None)
    except (OSError, ValueError, TypeError) as err:
        log.debug("the stored dtype of %s is unknown: %s", name, err)
        return None
    value = str(value).removeprefix("torch.") if value is not None else None
    return value if value in _SAFETENSORS_DTYPES.values() else None
