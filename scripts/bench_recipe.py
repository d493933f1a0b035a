#!/usr/bin/env python
r"""Benchmark the recommended recipe against the old default, as a practitioner runs them: a benchmark, not a test.

On the embedded SmolLM2, at whole-model ratios 0.1 and 0.2, each case is one ``fisherkron compress``
command run as a subprocess, with a fresh ``--cache-dir`` (and a fresh data folder, so that neither
the calibration nor the allocation's measurements are read from an earlier run's cache):

* ``recommended``: ``fisherkron compress smollm2 --ratio R --out OUT`` (the defaults:
  :data:`fisherkron.hf.allocation.RECOMMENDED`, KFAC-SVD with the KL-calibrated allocation on 32 C4
  batches of 2 x 256 tokens);
* ``old-default``: ``--method gfwsvd --allocation uniform --k 16 --batch-size 4`` (the command's
  default before the recipe: GFWSVD, one ratio for every layer, the old calibration defaults);
* ``gfwsvd-recipe``: ``--method gfwsvd`` (the recipe's allocation with GFWSVD's factors);
* ``gfwsvd-recipe-bounded``: the same under ``--max-disk`` set to a third of the disk the unbounded
  calibration's plan needs (the dry run's ``needs.disk_bytes``,
  :func:`fisherkron.hf.budget.calibration_needs`), or the smallest bound that works
  (``needs.min_max_disk``) where that is larger: what the bound costs in time.

Each compressed model is scored as the studies score one
(:meth:`fisherkron.experiments.llm_compression.Study.evaluate`): PTB test perplexity on its first
4,096 tokens in 512-token windows by the command itself (``--ppl-tokens 4096 --ppl-seq-len 512``, as
its help's first example runs it, so the command's time includes scoring PTB before and after), and
the Wikipedia text's on its first 4,096 tokens in 512-token windows by the studies' own
``first_tokens`` and :func:`fisherkron.perplexity` on the saved model. Beside them: the compress
command's wall time, the peak size of its cache folder (polled every 0.5 s), the parameter ratio it
reached, and the share of the cores other processes used meanwhile
(:class:`fisherkron.env.OtherLoad`): a time measured beside other work is an upper bound. The dense
model is scored once, as the reference row (PTB by ``fisherkron evaluate --ppl-tokens 4096 --seq-len
512``, the same call on the same windows, which every case's "before" must equal).

Every finished case is kept in ``<work>/cases/<case>-<ratio>.json`` (default work folder
``build/bench-recipe``) with the configuration and the code (a fingerprint of the package's sources)
that measured it; a re-run skips a finished case whose configuration and code match (``--force``
measures again; ``--keep-finished`` also keeps cases measured by other code). The table is
``<out>/bench_recipe.{csv,md,tex}`` with its provenance record (``make bench-recipe``, default out
``figures/bench``). ``--quick`` runs the same pipeline on a tiny random Llama saved to a temporary
folder (tiny calibration, 256 evaluation tokens) in about two minutes (``make bench-recipe-quick``).

Usage::

    python scripts/bench_recipe.py [--out figures/bench] [--work build/bench-recipe]
        [--ratios 0.1 0.2] [--cases recommended old-default ...] [--force] [--keep-finished]
    python scripts/bench_recipe.py --quick --out build/bench-recipe-quick
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import fisherkron as fk  # before torch: its OpenMP threads then wait passively
from fisherkron.core.conventions import FisherkronError
from fisherkron.env import OtherLoad, atomic_write, data_root, models_root
from fisherkron.hf.calibration.bounded import folder_bytes

#: the cases, in the order they are run and tabled
CASES = ("recommended", "old-default", "gfwsvd-recipe", "gfwsvd-recipe-bounded")
#: the bounded case's ``--max-disk``: this share of the unbounded plan's disk (or the smallest bound that works)
BOUND_SHARE = 1 / 3
#: seconds between two polls of a cache folder's size
POLL_S = 0.5
#: the record format of a finished case (a record of another format is measured again)
FORMAT = 1
#: how far a rerun's values may fall from these (fisherkron.repro.tolerance); perplexity: a compressed float32
#: model on another CPU (fisherkron.repro.verify_tolerances.PPL)
PPL = "rel=0.02"
TOLERANCES = {"case": "exact", "ratio": "exact", "method": "exact", "allocation": "exact", "calibration": "exact",
              "passes": "exact", "max_disk_gb": "exact", "params_ratio": "abs=1e-3", "ppl_ptb": PPL,
              "ppl_wiki": PPL, "ptb_x_dense": PPL, "compress_s": "timing", "peak_disk_gb": "timing",
              "others_load": "timing"}


@dataclass(frozen=True)
class Profile:
    """What a run compresses and how it scores: the embedded SmolLM2, or (``--quick``) a tiny random Llama."""

    name: str
    #: calibration options of the recipe's cases (empty: the command's defaults, the recipe's own)
    recipe: tuple[str, ...]
    #: the old default's calibration options
    old: tuple[str, ...]
    eval_tokens: int
    eval_seq_len: int


FULL = Profile("smollm2", recipe=(), old=("--k", "16", "--batch-size", "4"), eval_tokens=4096, eval_seq_len=512)
#: tiny: the old default's half as many batches of twice the size, as in the full profile; windows of the tiny
#: model's 64 positions. 16 batches: the gradients outweigh MFF's factors and the files' margins, so that the
#: bounded case's bound (the smallest that works) splits the layers into groups
QUICK = Profile("tiny-llama", recipe=("--k", "16", "--batch-size", "2", "--seq-len", "32"),
                old=("--k", "8", "--batch-size", "4", "--seq-len", "32"), eval_tokens=256, eval_seq_len=64)


def case_options(case: str, profile: Profile) -> list[str]:
    """The options of ``fisherkron compress`` that make ``case`` (``--max-disk`` of the bounded case aside).

    >>> case_options("old-default", FULL)
    ['--method', 'gfwsvd', '--allocation', 'uniform', '--k', '16', '--batch-size', '4']
    >>> case_options("recommended", FULL)
    []
    """
    if case == "recommended":
        return list(profile.recipe)
    if case == "old-default":
        return ["--method", "gfwsvd", "--allocation", "uniform", *profile.old]
    if case in ("gfwsvd-recipe", "gfwsvd-recipe-bounded"):
        return ["--method", "gfwsvd", *profile.recipe]
    raise FisherkronError(f"unknown case {case!r}; the cases: {', '.join(CASES)}")


def bound_for(needs: dict) -> int:
    """The bounded case's ``--max-disk`` in bytes: :data:`BOUND_SHARE` of the unbounded plan's disk, at least
    the smallest bound that works, rounded up to a whole kB.

    >>> bound_for({"disk_bytes": 16_048_638_208, "min_max_disk": 2_571_456_640})
    5349547000
    >>> bound_for({"disk_bytes": 3_000_000, "min_max_disk": 2_500_100})
    2501000
    """
    want = max(needs["disk_bytes"] * BOUND_SHARE, needs["min_max_disk"])
    return int(math.ceil(want / 1e3) * 1e3)


def code_fingerprint() -> str:
    """A hash of the package's Python sources: a finished case measured by other code is measured again."""
    root = Path(fk.__file__).resolve().parent
    h = hashlib.blake2b(digest_size=10)
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ measuring helpers
class DiskPeak:
    """The largest size of ``folder`` seen while the block ran (:func:`folder_bytes`, polled every ``every`` s)."""

    def __init__(self, folder: Path, every: float = POLL_S) -> None:
        self.folder, self.every, self.peak = Path(folder), every, 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while True:
            if self.folder.exists():
                self.peak = max(self.peak, folder_bytes(self.folder))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "DiskPeak":
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.folder.exists():  # what is left at the end counts too
            self.peak = max(self.peak, folder_bytes(self.folder))


class Clock:
    """Progress lines on stderr, each with the seconds since the run started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {text}", file=sys.stderr, flush=True)


def fisherkron_cli(*args: str, env: dict, log: Path | None = None, what: str) -> dict:
    """Run ``fisherkron ARGS`` (this interpreter's) and return its final JSON line; a failure names the command
    and ends with the last lines of its stderr (kept whole in ``log``)."""
    argv = [sys.executable, "-m", "fisherkron", *map(str, args)]
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise FisherkronError(f"{what} failed (exit status {proc.returncode}): {' '.join(argv[2:])}\n{tail}")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if not lines:
        raise FisherkronError(f"{what} printed no JSON line: {' '.join(argv[2:])}\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def wiki_ppl(model, tok, profile: Profile) -> tuple[float, int]:
    """The Wikipedia text's perplexity as the studies score it: its first ``eval_tokens`` tokens
    (:func:`~fisherkron.experiments.llm_compression.first_tokens`) in ``eval_seq_len`` windows."""
    from fisherkron.experiments.llm_compression import first_tokens

    ids = first_tokens(tok, fk.wiki_text(), profile.eval_tokens)
    res = fk.perplexity(model, None, ids, seq_len=profile.eval_seq_len)
    return res.ppl, res.tokens


def has_max_disk(env: dict) -> bool:
    """Whether this checkout's ``fisherkron compress`` has ``--max-disk``."""
    proc = subprocess.run([sys.executable, "-m", "fisherkron", "compress", "--help"], env=env,
                          capture_output=True, text=True)
    return proc.returncode == 0 and "--max-disk" in proc.stdout


# ------------------------------------------------------------------------------------------ the run
class Bench:
    """One run: the model, the work folder, and the finished cases it keeps there."""

    def __init__(self, model: str, profile: Profile, work: Path, *, force: bool, keep_finished: bool,
                 clock: Clock) -> None:
        self.model, self.profile, self.work, self.clock = model, profile, work, clock
        self.force, self.keep_finished = force, keep_finished
        self.code = code_fingerprint()
        self.cases_dir = work / "cases"
        self.cases_dir.mkdir(parents=True, exist_ok=True)
        self.measured_now: list[str] = []
        self._max_disk: bool | None = None

    def env(self, scratch: Path) -> dict:
        """The subprocesses' environment: a fresh data folder (no allocation cache to read), the usual models."""
        env = dict(os.environ)
        env.update(FISHERKRON_DATA=str(scratch / "data"), FISHERKRON_MODELS=str(models_root()),
                   HF_HOME=os.environ.get("HF_HOME", str(data_root() / "hf_home")))
        return env

    def max_disk_supported(self) -> bool:
        if self._max_disk is None:
            self._max_disk = has_max_disk(dict(os.environ))
        return self._max_disk

    def _finished(self, key: str, config: dict) -> dict | None:
        """The kept record of ``key`` if it may be reused, else ``None`` (with a line saying why it is not)."""
        path = self.cases_dir / f"{key}.json"
        if self.force or not path.exists():
            return None
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            self.clock.say(f"{key}: its record {path} cannot be read ({exc}); measuring it again")
            return None
        if rec.get("format") != FORMAT or rec.get("config") != config:
            self.clock.say(f"{key}: its record was measured with another configuration; measuring it again")
            return None
        if rec.get("code") != self.code and not self.keep_finished:
            self.clock.say(f"{key}: its record was measured by other code (the package changed since); measuring it "
                           f"again (--keep-finished keeps it)")
            return None
        self.clock.say(f"{key}: finished at {rec.get('finished_utc')}, kept (--force measures it again)")
        return rec

    def _keep(self, key: str, rec: dict) -> dict:
        atomic_write(self.cases_dir / f"{key}.json", lambda t: Path(t).write_text(json.dumps(rec, indent=1) + "\n"))
        self.measured_now.append(key)
        return rec

    def _scratch(self, key: str) -> Path:
        scratch = self.work / "scratch" / key
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        return scratch

    def dense(self) -> dict:
        """The dense model's PTB and Wikipedia perplexity (the reference row)."""
        p = self.profile
        config = {"case": "dense", "model": p.name, "eval_tokens": p.eval_tokens, "eval_seq_len": p.eval_seq_len}
        rec = self._finished("dense", config)
        if rec is not None:
            return rec
        self.clock.say("dense: start (PTB and Wikipedia perplexity)")
        scratch = self._scratch("dense")
        try:
            ptb = fisherkron_cli("evaluate", self.model, "--ppl-tokens", p.eval_tokens, "--seq-len", p.eval_seq_len,
                                 "-q", env=self.env(scratch), what="the dense model's PTB perplexity")
            model, tok = fk.load_model(self.model, task="causal-lm")
            wiki, wiki_tokens = wiki_ppl(model, tok, p)
            del model
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rec = {"format": FORMAT, "config": config, "code": self.code, "ptb": ptb, "ppl_ptb": ptb["ptb_ppl"],
               "ppl_wiki": wiki, "wiki_tokens": wiki_tokens, "params": ptb["params"],
               "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.clock.say(f"dense: done; PTB {rec['ppl_ptb']:.4g}, Wikipedia {wiki:.4g}")
        return self._keep("dense", rec)

    def case(self, case: str, ratio: float) -> dict | None:
        """Run (or read back) one case at one ratio; ``None`` when it cannot run here (said on stderr)."""
        p = self.profile
        key = f"{case}-{ratio:g}"
        options = case_options(case, p)
        bounded = case.endswith("-bounded")
        config = {"case": case, "ratio": ratio, "model": p.name, "options": options,
                  "max_disk": f"{BOUND_SHARE:.4g} of the unbounded plan's disk, at least its min_max_disk"
                  if bounded else None, "eval_tokens": p.eval_tokens, "eval_seq_len": p.eval_seq_len}
        rec = self._finished(key, config)
        if rec is not None:
            return rec
        if bounded and not self.max_disk_supported():
            self.clock.say(f"{key}: not run: this checkout's `fisherkron compress` has no --max-disk (run it again "
                           f"once the option is there)")
            return None
        scratch = self._scratch(key)
        env, cache, out = self.env(scratch), scratch / "cache", scratch / "model"
        head = ["compress", self.model, "--ratio", ratio]
        try:
            needs = plan = None
            if bounded:  # the unbounded plan, then the bounded one (its groups and passes)
                plan = fisherkron_cli(*head, *options, "--dry-run", "-q", env=env, what=f"{key}'s unbounded plan")
                options = [*options, "--max-disk", str(bound_for(plan["needs"]))]
                needs = fisherkron_cli(*head, *options, "--dry-run", "-q", env=env,
                                       what=f"{key}'s bounded plan")["needs"]
            argv = [*head, "--out", out, "--cache-dir", cache, "--ppl-tokens", p.eval_tokens, "--ppl-seq-len",
                    p.eval_seq_len, "-q", *options]
            self.clock.say(f"{key}: start: fisherkron {' '.join(map(str, argv))}")
            load0 = os.getloadavg()
            with OtherLoad() as load, DiskPeak(cache) as disk:
                t0 = time.perf_counter()
                summary = fisherkron_cli(*argv, env=env, log=self.work / "logs" / f"{key}.log", what=key)
                seconds = time.perf_counter() - t0
            model, tok = fk.load_compressed(out, return_tokenizer=True)
            wiki, wiki_tokens = wiki_ppl(model, tok, p)
            del model
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        cal = summary["calibration"]
        max_disk = None if needs is None else int(options[options.index("--max-disk") + 1])
        rec = {"format": FORMAT, "config": config, "code": self.code,
               "command": "fisherkron " + " ".join(p.name if a == self.model else str(a) for a in argv)
                          .replace(str(scratch), "SCRATCH"),
               "method": summary["method"], "allocation": summary["allocation"],
               "calibration": f"{cal['k']} x {cal['batch_size']} x {cal['seq_len']}",
               "passes": cal["k"] * (1 if needs is None else needs["groups"]), "max_disk": max_disk,
               "params_ratio": summary["ratio"], "params_before": summary["params_before"],
               "params_after": summary["params_after"], "ppl_ptb": summary["ptb_ppl_after"], "ppl_wiki": wiki,
               "ppl_ptb_before": summary["ptb_ppl_before"], "ptb_tokens": summary["ptb_scored_tokens"], "wiki_tokens": wiki_tokens, "compress_s": seconds,
               "peak_disk": disk.peak, "plan": None if plan is None else plan["needs"], "plan_bounded": needs,
               "others_load": load.share, "load_average": [load0, os.getloadavg()], "summary": summary,
               "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if max_disk is not None and disk.peak > max_disk:
            self.clock.say(f"{key}: WARNING: the cache folder reached {disk.peak:,} bytes, above --max-disk "
                           f"{max_disk:,}")
        self.clock.say(f"{key}: done in {seconds:.1f} s; ratio {summary['ratio']:.4f}, PTB {summary['ptb_ppl_after']:.4g}, "
                       f"Wikipedia {wiki:.4g}, peak cache {disk.peak / 1e9:.3g} GB"
                       + ("" if max_disk is None else f" (bound {max_disk / 1e9:.3g} GB)")
                       + ("" if load.share is None else f", others' CPU share {load.share:.2f}"))
        return self._keep(key, rec)


def table(dense: dict, records: list[dict]):
    """The rows: the dense reference, then one per case and ratio."""
    import pandas as pd

    nan = float("nan")
    rows = [{"case": "dense", "ratio": 0.0, "method": "", "allocation": "", "calibration": "", "passes": 0,
             "max_disk_gb": nan, "params_ratio": 0.0, "ppl_ptb": dense["ppl_ptb"], "ppl_wiki": dense["ppl_wiki"],
             "ptb_x_dense": 1.0, "compress_s": nan, "peak_disk_gb": nan, "others_load": nan}]
    for r in records:
        rows.append({"case": r["config"]["case"], "ratio": r["config"]["ratio"], "method": r["method"],
                     "allocation": r["allocation"], "calibration": r["calibration"], "passes": r["passes"],
                     "max_disk_gb": nan if r["max_disk"] is None else r["max_disk"] / 1e9,
                     "params_ratio": r["params_ratio"], "ppl_ptb": r["ppl_ptb"], "ppl_wiki": r["ppl_wiki"],
                     "ptb_x_dense": r["ppl_ptb"] / dense["ppl_ptb"], "compress_s": r["compress_s"],
                     "peak_disk_gb": r["peak_disk"] / 1e9,
                     "others_load": nan if r["others_load"] is None else r["others_load"]})
    return pd.DataFrame(rows)


def tiny_llama_folder(folder: Path) -> Path:
    """A tiny random Llama (seeded) with a character-level tokenizer, saved to ``folder`` (``--quick``'s model)."""
    import torch
    from transformers import BertTokenizerFast, LlamaConfig, LlamaForCausalLM

    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(chars) + [f"##{c}" for c in chars]
             + list("0123456789") + list(".,'-$&?!<>"))  # 77 tokens
    torch.manual_seed(0)
    # weights 5 times the usual scale: the outputs depend on them (at 0.02 every token is near 1/97 and no
    # compression moves the perplexity), so the cases' perplexities differ
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      initializer_range=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    # the vocabulary as a dict: transformers 5 ignores a vocab_file here, leaving 5 tokens (every word [UNK])
    BertTokenizerFast(vocab={v: i for i, v in enumerate(vocab)}, eos_token="[SEP]").save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the benchmark and write the table."""
    from fisherkron.repro.figures import output_dir, save_table

    p = argparse.ArgumentParser(prog="scripts/bench_recipe.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="figures/bench", help="folder of the table (default: figures/bench)")
    p.add_argument("--work", default=None,
                   help="folder of the finished cases, logs and scratch (default: build/bench-recipe; with --quick, "
                        "OUT/work)")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2], help="whole-model ratios (default 0.1 0.2)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="the cases to run (default: all)")
    p.add_argument("--force", action="store_true", help="measure finished cases again")
    p.add_argument("--keep-finished", action="store_true",
                   help="keep finished cases measured by other code (the package changed since)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny random Llama, tiny calibration, 256 evaluation tokens (about 2 minutes)")
    a = p.parse_args(argv)
    clock = Clock()
    started = time.perf_counter()
    profile = QUICK if a.quick else FULL
    out = Path(a.out)
    work = output_dir(a.work if a.work else (out / "work" if a.quick else "build/bench-recipe"))
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fisherkron-bench-recipe-") as tmp, OtherLoad() as load:
        model = str(tiny_llama_folder(Path(tmp) / "tiny-llama")) if a.quick else "smollm2"
        bench = Bench(model, profile, work, force=a.force, keep_finished=a.keep_finished, clock=clock)
        dense = bench.dense()
        records, not_run = [], []
        for ratio in a.ratios:
            for case in a.cases:
                rec = bench.case(case, ratio)
                if rec is None:
                    not_run.append(f"{case}-{ratio:g}")
                else:
                    records.append(rec)
    df = table(dense, records)
    # every command scored the dense model too, by the same call on the same windows: the reference row's value
    before = max((abs(r["ppl_ptb_before"] / dense["ppl_ptb"] - 1) for r in records), default=0.0)
    if before > 1e-6:
        clock.say(f"WARNING: the commands' PTB perplexity of the dense model differs from the reference row's by up "
                  f"to {before:.2g} (relative)")
    params = {"model": profile.name, "ratios": a.ratios, "cases": a.cases, "quick": a.quick, "force": a.force,
              "keep_finished": a.keep_finished, "eval_tokens": profile.eval_tokens,
              "eval_seq_len": profile.eval_seq_len, "bound_share": BOUND_SHARE, "poll_seconds": POLL_S}
    extra = {"ptb_before_max_rel_diff": before, "load_average_start": load_start, "load_average_end": os.getloadavg(), "others_load": load.share,
             "measured_now": bench.measured_now, "not_run": not_run,
             "not_run_why": "fisherkron compress has no --max-disk in this checkout" if not_run else None,
             "commands": {f"{r['config']['case']}-{r['config']['ratio']:g}": r["command"] for r in records},
             "cases": {f"{r['config']['case']}-{r['config']['ratio']:g}": {
                 "finished_utc": r["finished_utc"], "load_average": r["load_average"], "code": r["code"],
                 "plan_disk_bytes": None if r["plan"] is None else r["plan"]["disk_bytes"],
                 "min_max_disk": None if r["plan"] is None else r["plan"]["min_max_disk"],
                 "allocation_cost": r["summary"].get("allocation_cost")} for r in records},
             "timings": "wall time of each compress command beside whatever else ran (others_load): an upper bound "
                        "of the time on idle cores"}
    save_table(df, "bench_recipe", out, params, started=started, notebook="scripts/bench_recipe.py",
               caption=f"The recommended recipe against the old default on {profile.name}: perplexity (first "
                       f"{profile.eval_tokens} tokens, {profile.eval_seq_len}-token windows), time and peak "
                       f"calibration disk of one fisherkron compress command",
               label="tab:bench_recipe", floatfmt=".4g", extra=extra, tolerances=TOLERANCES)
    print("\n" + (output_dir(out) / "bench_recipe.md").read_text(), flush=True)
    clock.say(f"table written to {out}/bench_recipe.{{csv,md,tex}}; measured now: {len(bench.measured_now)}, "
              f"kept: {len(records) + 1 - len(bench.measured_now)}, not run: {len(not_run)}"
              + ("" if load.share is None else f"; others' CPU share {load.share:.2f}"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FisherkronError as exc:  # a command that failed: its line and the end of its stderr, no traceback
        print(f"scripts/bench_recipe.py: {exc}", file=sys.stderr)
        sys.exit(1)
