#!/usr/bin/env python
r"""Which caches a change re-keys: the code part of each cache's key, here and at another revision.

Every cache of the package keys its entries by what computed them, the code included (a digest of the source
files that compute an entry, :func:`fisherkron.env.code_digest`, or a version string), and many keys hold the
model's :func:`~fisherkron.hf.calibration.model_fingerprint`. A change to one of those files re-keys the whole
cache: its entries are computed again on their next run (hours for the calibration statistics and the sweeps).
This script evaluates, for each cache, the part of its key that comes from the code, in the working tree and in
a checkout of ``REV`` (a temporary ``git worktree``), and prints which differ::

    python scripts/cache_keys.py 0ccb310      # what the commits since 0ccb310 re-key
    python scripts/cache_keys.py --here       # only this tree's values (every expression still evaluates)

A family whose expression cannot be evaluated at ``REV`` (a name that did not exist yet) is reported as such.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: each cache, and the expression (in the package at a revision) that gives the part of its keys the code sets
FAMILIES = {
    "calibration entries (data/cache/calibration)": "fisherkron.hf.calibration.keys.code_version()",
    "decompositions and MFF factors (data/cache/decompositions)": "fisherkron.hf.decompositions._code_tag()",
    "sensitivity sweeps (data/cache/allocation)": "fisherkron.hf.sensitivity._code_version()",
    "decoder-study scores (three decoder notebooks, allocation cost, scale)":
        "fisherkron.experiments.llm_compression.code_tag()",
    "learned truncation and LoRA runs": "fisherkron.experiments.extra_compression.CODE_VERSION + '/' + "
        "fisherkron.experiments.llm_compression.sources_hash(fisherkron.experiments.extra_compression._SOURCES)",
    "truncation checkpoints": "fisherkron.hf.truncation.CODE_VERSION",
    "LoRA checkpoints": "fisherkron.hf.recovery.CODE_VERSION",
    "GLUE fine-tuned encoders (data/cache/finetune)": "fisherkron.experiments.glue._finetune_code()",
    "calibration study cost records": "fisherkron.experiments.calibration_study.CODE_VERSION",
    "the model in every key (a tiny seeded Llama's model_fingerprint)": "_tiny_model_fingerprint()",
}

#: run in a fresh interpreter with the revision's package first on the path; prints one JSON object
SNIPPET = r"""
import importlib, json, sys
import fisherkron.experiments.llm_compression, fisherkron.experiments.extra_compression
import fisherkron.experiments.glue, fisherkron.experiments.calibration_study, fisherkron.hf.decompositions
import fisherkron.hf.sensitivity, fisherkron.hf.truncation, fisherkron.hf.recovery
assert fisherkron.__file__.startswith(sys.argv[1]), fisherkron.__file__


def _tiny_model_fingerprint():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from fisherkron.hf.calibration import model_fingerprint

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    model.config._name_or_path = "/a/folder"
    return model_fingerprint(model)


out = {}
for name, expr in json.loads(sys.argv[2]).items():
    try:
        out[name] = str(eval(expr))
    except Exception as exc:
        out[name] = f"(cannot be evaluated: {type(exc).__name__}: {exc})"
print(json.dumps(out))
"""


def evaluate(tree: Path) -> dict[str, str]:
    """Each family's value in the package of ``tree`` (its ``fisherkron/``), in a fresh interpreter."""
    run = subprocess.run([sys.executable, "-c", SNIPPET, str(tree), json.dumps(FAMILIES)], cwd=tree,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                              "TRANSFORMERS_OFFLINE": "1"}, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"[cache-keys] the package in {tree} does not import: {run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", nargs="?", help="the revision to compare with (a commit, a tag, HEAD~3)")
    ap.add_argument("--here", action="store_true", help="print this tree's values only")
    args = ap.parse_args(argv)
    if not args.here and not args.rev:
        ap.error("name a revision to compare with, or pass --here")
    here = evaluate(ROOT)
    if args.here:
        for name, value in here.items():
            print(f"{name}: {value}")
        return 1 if any(v.startswith("(cannot") for v in here.values()) else 0
    with tempfile.TemporaryDirectory(prefix="cache-keys-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(tree), args.rev],
                       check=True)
        try:
            then = evaluate(tree)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    rekeyed = [n for n in FAMILIES if then[n] != here[n]]
    for name in FAMILIES:
        print(f"{'re-keyed' if name in rekeyed else 'same    '}  {name}")
        if name in rekeyed:
            print(f"          {args.rev}: {then[name]}\n          here: {here[name]}")
    print(f"[cache-keys] {len(rekeyed)} of {len(FAMILIES)} caches re-keyed since {args.rev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
