"""Fingerprints and cache keys: an entry is reused only for exactly what it was computed from.

The key of a calibration entry covers the model (:func:`model_record`: class, config, every
parameter and buffer), the batches (every tensor, in order), the layers, ``k``, the seed, the
statistics, the gradient encoding and granularity, the loss function (its code and everything it
captures, :func:`loss_key`) and the code version (:func:`code_version`: a hash of this package's
source). The model's record travels with the statistics (``config["model"]``), so compression
refuses statistics of another model (:func:`model_difference`) without hashing it twice.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import types
from pathlib import Path

import torch
from torch import nn

from ...core.conventions import FisherkronError
from ...env import code_digest

__all__ = ["CODE_VERSION", "PROVENANCE", "WHERE", "model_fingerprint", "model_record", "model_difference", "tensor_digest",
           "data_fingerprint", "layer_fingerprint", "loss_key", "code_version", "calibration_key",
           "config_key"]

CODE_VERSION = "calibration-2"  # bump when the meaning of a cached file changes
#: config fields that say where a model came from or what its forward returns, not what it computes (a model
#: saved and loaded again differs in them; a sequence classifier sets ``problem_type`` in its first forward
#: with labels, that is, while its statistics are collected): :func:`model_difference` leaves them out, the
#: cache key does not
PROVENANCE = ("_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "_commit_hash",
              "use_cache", "return_dict", "output_attentions", "output_hidden_states", "problem_type")
#: config fields that say only where a model was loaded from: the calibration key leaves them out, so the same
#: model loaded from another folder (another checkout, ``$FISHERKRON_MODELS``, a copy) finds its statistics
WHERE = ("_name_or_path", "_commit_hash")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().tobytes()


def _tensor_buffer(t: torch.Tensor):
    """The bytes :func:`_tensor_bytes` gives, as a numpy array hashed in place (no copy into ``bytes``)."""
    t = t.detach().cpu().contiguous()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def tensor_digest(t: torch.Tensor) -> str:
    """Hash of one tensor's shape and values, as :func:`model_record` keeps it for each parameter and buffer."""
    h = hashlib.blake2b(str(tuple(t.shape)).encode(), digest_size=12)
    h.update(_tensor_buffer(t))
    return h.hexdigest()


def _digest(*parts) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def model_record(model: nn.Module) -> dict:
    """What identifies a model's computation, one pass over its tensors: the record statistics carry.

    ``{"class": name, "config": {field: digest} or None, "tensors": {name: digest}, "fingerprint": digest}``:
    a digest of each config field and of each parameter and buffer (its shape and values, read as
    :func:`model_fingerprint` reads them: bfloat16 as float32, any device), and ``fingerprint``, a
    digest of the class, the tensors and the config fields that are not :data:`PROVENANCE`. The
    calibration key hashes the whole record but the fields of :data:`WHERE`; compression compares
    ``fingerprint`` (:func:`model_difference`).
    """
    tensors = {name: tensor_digest(t) for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    cfg = getattr(model, "config", None)
    config = None
    if cfg is not None and hasattr(cfg, "to_json_string"):
        config = {k: _digest(v) for k, v in json.loads(cfg.to_json_string(use_diff=False)).items()}
    record = {"class": type(model).__name__, "config": config, "tensors": tensors}
    computes = {k: v for k, v in (config or {}).items() if k not in PROVENANCE}
    record["fingerprint"] = _digest(record["class"], computes if config is not None else None, tensors)
    return record


def model_difference(want: dict, model: nn.Module) -> str | None:
    """How ``model`` differs from the one whose :func:`model_record` is ``want`` (``None``: it does not).

    One hash of ``model``'s tensors. The answer completes "the statistics were collected on ..." and
    names the first difference: the class, a parameter or buffer (in ``model``'s order, then those
    it lacks), or a config field outside :data:`PROVENANCE`.

    >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    >>> model_difference(model_record(a), a) is None
    True
    >>> model_difference(model_record(a), b)
    "other weights, a model whose parameters differ from this one's (first: weight)"
    """
    got = model_record(model)
    if got["fingerprint"] == want.get("fingerprint"):
        return None
    if got["class"] != want.get("class"):
        return f"another class of model, a {want.get('class')}, not this {got['class']}"
    params = {n for n, _ in model.named_parameters()}
    theirs = want.get("tensors") or {}
    for name, digest in got["tensors"].items():
        if theirs.get(name) != digest:
            kind = "parameters" if name in params else "buffers"
            lacks = ", which that model lacked" if name not in theirs else ""
            return f"other weights, a model whose {kind} differ from this one's (first: {name}{lacks})"
    for name in theirs:
        if name not in got["tensors"]:
            return (f"other weights, a model whose parameters differ from this one's (first: {name}, which this "
                    f"model lacks)")
    mine, theirs = got["config"] or {}, want.get("config") or {}
    for field in sorted(set(mine) | set(theirs)):
        if field not in PROVENANCE and mine.get(field) != theirs.get(field):
            return f"a model whose config differs from this one's (first: {field})"
    return "another model, one whose class, config, parameters or buffers differ from this one's"


def model_fingerprint(model: nn.Module, *, with_location: bool = False) -> str:
    """Hash of the model class, config and every parameter and buffer (weights decide the gradients): the model in
    the keys of scores, sweeps, fine-tuned models and training runs.

    The config fields of :data:`WHERE` (the folder it was loaded from) are left out, so the same model loaded from
    another checkout, a copy or a relative path finds its cached results (``make ledger-restore`` on another
    machine). ``with_location=True``: the hash with them, as earlier versions computed it (the model that
    calibration statistics of those versions record).

    >>> import copy
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> a = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
    ...                                  num_attention_heads=2, num_key_value_heads=2))
    >>> b = copy.deepcopy(a)
    >>> b.config._name_or_path = "/elsewhere/the-same-model"
    >>> model_fingerprint(a) == model_fingerprint(b), model_fingerprint(a, with_location=True) == model_fingerprint(
    ...     b, with_location=True)
    (True, False)
    """
    h = hashlib.blake2b(digest_size=20)
    h.update(type(model).__name__.encode())
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        text = cfg.to_json_string(use_diff=False)
        if not with_location:
            fields = {k: v for k, v in json.loads(text).items() if k not in WHERE}
            text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
        h.update(text.encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def data_fingerprint(batches) -> str:
    """Hash of every tensor (and value) in every batch, in order."""
    h = hashlib.blake2b(digest_size=20)
    for b in batches:
        for key in sorted(b):
            v = b[key]
            h.update(key.encode())
            h.update(_tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def layer_fingerprint(module: nn.Linear) -> str:
    """Hash of one linear layer's weight and bias: statistics belong to exactly these weights."""
    h = hashlib.blake2b(digest_size=12)
    for t in (module.weight, module.bias):
        if t is not None:
            h.update(str(tuple(t.shape)).encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


_PLAIN = (type(None), bool, int, float, str, bytes)
_LIBRARIES = {"torch", "transformers", "numpy", "scipy", "math", "operator", "functools", "builtins"}


def _describe(value, depth: int = 0):
    """A stable, hashable description of a value a loss function depends on, or raise TypeError."""
    if depth > 6:
        raise TypeError("nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_describe(v, depth + 1) for v in value]]
    if isinstance(value, dict):
        return {str(k): _describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape),
                hashlib.blake2b(_tensor_bytes(value), digest_size=12).hexdigest()]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, type(functools)):  # a module
        return ["module", value.__name__]
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        return loss_key(value, depth + 1)
    raise TypeError(f"it depends on a {type(value).__name__}")


def _code_description(code) -> list:
    consts = [_code_description(c) if hasattr(c, "co_code") else _describe(c) for c in code.co_consts]
    return [code.co_code.hex(), consts, list(code.co_names), list(code.co_varnames)]


def loss_key(loss_fn, depth: int = 0):
    """What determines ``loss_fn``'s result, for the cache key: its code, captured values and arguments.

    Functions (lambdas and closures included) are described by their bytecode, constants,
    default arguments, the values their closures capture and the global values they read;
    ``functools.partial`` by its function and arguments; tensors by their contents. Raises
    :class:`TypeError` when something it depends on cannot be described (e.g. a captured
    model or an object with state), so that it is never cached under a wrong key.
    """
    if loss_fn is None:
        return "model(**batch).loss"
    if isinstance(loss_fn, types.MethodType):
        return ["method", _describe(loss_fn.__self__, depth + 1), loss_key(loss_fn.__func__, depth + 1)]
    if not isinstance(loss_fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        raise TypeError(f"it is a {type(loss_fn).__name__} object, whose state cannot be keyed")
    root = (getattr(loss_fn, "__module__", None) or "").split(".")[0]
    if root in _LIBRARIES:  # a library function: its name and the library's version determine it
        import importlib.metadata as md
        try:
            version = md.version(root)
        except md.PackageNotFoundError:
            version = None
        return ["library", loss_fn.__module__, getattr(loss_fn, "__qualname__", repr(loss_fn)), version]
    if isinstance(loss_fn, functools.partial):
        return ["partial", loss_key(loss_fn.func, depth + 1), _describe(list(loss_fn.args), depth + 1),
                _describe(dict(loss_fn.keywords), depth + 1)]
    code = getattr(loss_fn, "__code__", None)
    if code is None:  # a builtin outside the known libraries
        return ["builtin", getattr(loss_fn, "__module__", None), getattr(loss_fn, "__qualname__", None)]
    cells = [_describe(c.cell_contents, depth + 1) for c in (loss_fn.__closure__ or ())]
    glob = getattr(loss_fn, "__globals__", {})
    used = {name: _describe(glob[name], depth + 1) for name in code.co_names
            if name in glob and not isinstance(glob[name], type) and depth < 4}
    return [loss_fn.__module__, loss_fn.__qualname__, _code_description(code),
            _describe(list(loss_fn.__defaults__ or ()), depth + 1),
            _describe(dict(loss_fn.__kwdefaults__ or {}), depth + 1), cells, used]


def code_version() -> str:
    """The package version, :data:`CODE_VERSION` and a hash of this package's source files.

    Any edit to what the calibration code computes changes every key: an entry is never read by code
    that might mean something else by its files. Comments, docstrings and layout are not part of it
    (:func:`fisherkron.env.code_digest`).
    """
    from ..._version import __version__

    return f"{__version__}/{CODE_VERSION}/{code_digest(sorted(Path(__file__).parent.glob('*.py')))}"


def calibration_key(model: nn.Module, batches, names: list[str], *, k: int, seed: int, stats, grad_dtype: str,
                    granularity: str, loss_fn, loss_name: str | None, cache: bool) -> tuple[dict, str]:
    """``(config, key)`` of a calibration: what it was computed from, and its hash (the entry's folder name).

    ``loss_name`` stands for ``loss_fn`` when given; otherwise :func:`loss_key` describes it, and a
    loss that cannot be described is refused when ``cache`` is on (it would be keyed wrongly).
    """
    if loss_name is not None:
        described = ["named", str(loss_name)]
    else:
        try:
            described = loss_key(loss_fn)
        except TypeError as exc:
            if cache:
                raise FisherkronError(f"loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r} cannot be keyed for "
                                      f"the calibration cache ({exc}); pass loss_name='a name unique to this "
                                      f"loss' or cache=False") from None
            described = None
    loss_hash = hashlib.blake2b(json.dumps(described, sort_keys=True, default=str).encode(),
                                digest_size=12).hexdigest()
    record = model_record(model)
    if record["config"] is not None:  # the same model from another folder is the same model
        record["config"] = {k: v for k, v in record["config"].items() if k not in WHERE}
    config = {"model": record, "data": data_fingerprint(batches), "layers": names,
              "k": k, "seed": seed, "stats": sorted(stats), "code": code_version(),
              "grad_dtype": grad_dtype, "granularity": granularity,
              "loss_fn": [getattr(loss_fn, "__qualname__", None), loss_hash]}
    return config, config_key(config)


def config_key(config: dict) -> str:
    """The cache key of a calibration's ``config``: the name of its entry's folder."""
    return hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16).hexdigest()
