"""What a failed training run leaves behind: learned truncation and LoRA recovery on tiny random Llama decoders.

Both trainers stop at the step where a NaN or an infinity appears and put the model back bit for bit;
they refuse an upward-annealing schedule and an unwritable checkpoint folder before any work; a
checkpoint write is whole even under SIGTERM, and the temporary of a writer killed outright is removed
by the next run in that folder.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fisherkron.core.conventions import FisherkronError
from fisherkron.hf.basis_sharing import compress_basis_sharing
from fisherkron.hf.calibration import collect_calibration, default_loss
from fisherkron.hf.recovery import recover
from fisherkron.hf.surgery import compress
from fisherkron.hf.truncation import budget_ranks, learn_truncation, train_truncation
from tiny_models import tiny_llama, token_batches

TESTS = Path(__file__).resolve().parent
TMP = ".fisherkron-tmp-"
TRAINERS = ("recovery", "truncation")
#: a child process imports torch and transformers and trains a few steps of a tiny model
CHILD_SECONDS = 300


def compressed(seed=0):
    model = tiny_llama(seed)
    compress(model, "svd", None, ratio=0.3)
    return model


def model_for(trainer):
    return compressed() if trainer == "recovery" else tiny_llama()


def train(trainer, model, **options):
    """Four steps of LoRA recovery on the compressed model, or of learned truncation (SVD) on the dense one."""
    options = {"steps": 4, **options}
    if trainer == "recovery":
        return recover(model, token_batches(), **{"lr": 5e-3, **options})
    return learn_truncation(model, "svd", None, token_batches(), ratio=0.3, **options)


class CountingLoss:
    """``default_loss``, counted; from call ``bad`` on, ``spoil(model, loss)`` is returned instead."""

    def __init__(self, bad=None, spoil=None):
        self.calls, self.bad, self.spoil = 0, bad, spoil

    def __call__(self, model, batch):
        self.calls += 1
        loss = default_loss(model, batch)
        return self.spoil(model, loss) if self.bad is not None and self.calls >= self.bad else loss


def nan_loss(model, loss):
    return loss * float("nan")


def nan_gradient(model, loss):
    """The loss unchanged (``sqrt(0) = 0``), its gradient NaN (``inf * 0``) for the first trained parameter."""
    p = next(p for p in model.parameters() if p.requires_grad)
    return loss + torch.sqrt(0.0 * p.sum())


def state(model):
    """Everything a run must leave as it found it: each tensor's bytes, the flags, the module tree, each mode."""
    return ({k: v.detach().cpu().contiguous().view(torch.uint8).clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            [(n, type(m).__name__, m.training) for n, m in model.named_modules()])


def assert_unchanged(model, before):
    bits, flags, modules = state(model)
    assert bits.keys() == before[0].keys()
    assert [k for k in bits if not torch.equal(bits[k], before[0][k])] == []
    assert (flags, modules) == before[1:]


def temporaries(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith(TMP))


def child_env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- non-finite training

SPOILED = [("recovery", {}), ("recovery", {"rebalance": True}), ("truncation", {})]


@pytest.mark.parametrize("trainer,extra", SPOILED)
def test_a_nan_loss_stops_the_run_at_its_step_and_leaves_the_model_as_it_was(trainer, extra, tmp_path):
    model = model_for(trainer)
    model.train()
    model.model.layers[0].eval()  # each module's mode is put back, a mixed one included
    before = state(model)
    loss = CountingLoss(bad=3, spoil=nan_loss)
    ckpt = tmp_path / "run.pt"
    with pytest.raises(FisherkronError, match=r"stopped at step 3 of 4: the loss is nan; the model is left as it "
                                              r"was before the call\. Lower the learning rate"):
        train(trainer, model, loss_fn=loss, checkpoint=ckpt, checkpoint_every=1, **extra)
    assert loss.calls == 3  # no forward pass after the one that gave NaN
    assert_unchanged(model, before)
    assert torch.load(ckpt, weights_only=True)["step"] == 2  # the last good step; the NaN one never written


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_nonfinite_gradient_under_a_finite_loss_stops_the_run(trainer):
    model = model_for(trainer)
    before = state(model)
    with pytest.raises(FisherkronError, match=r"stopped at step 2 of 4: the gradient of (the position of )?\S+ is not "
                                              r"finite \(loss "):
        train(trainer, model, loss_fn=CountingLoss(bad=2, spoil=nan_gradient))
    assert_unchanged(model, before)


#: where lr = 1e30 breaks a run first: measured, the LoRA loss is NaN and Adam's update of a position
#: overflows float32; the loss may read inf and the overflow come one stage earlier on another CPU
BROKEN = r"(the loss is (nan|inf)|(the gradient of )?\S+( \S+)* is not finite)"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_learning_rate_far_too_high_stops_the_run_where_it_breaks(trainer):
    """At lr = 1e30 the first update is finite and the second step breaks; unchecked, recovery would merge
    NaN into every factor and truncation fail on a NaN-to-integer conversion."""
    model = model_for(trainer)
    before = state(model)
    with pytest.raises(FisherkronError, match=rf"stopped at step 2 of 4: {BROKEN}.*Lower the learning rate "
                                              rf"\(lr=1e\+30"):
        train(trainer, model, lr=1e30, min_lr=0.0)
    assert_unchanged(model, before)


def test_a_lora_weight_broken_by_the_update_stops_recovery_at_that_step(monkeypatch):
    """A finite loss and gradient, then an update that leaves an infinity (as a float16 overflow would)."""
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] >= 3:
            with torch.no_grad():
                self.param_groups[0]["params"][-1].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    model = compressed()
    before = state(model)
    with pytest.raises(FisherkronError, match=r"stopped at step 3 of 4: \S+lora_B\S+ is not finite after the update"):
        train("recovery", model)
    assert_unchanged(model, before)


def test_budgeted_ranks_of_nonfinite_positions_are_a_one_line_error():
    """Not a raw ValueError from int(round(nan))."""
    with pytest.raises(FisherkronError, match=r"the soft rank of b is nan \(1 of 2 layers not finite\); train the "
                                              r"positions again with a lower learning rate"):
        budget_ranks({"a": 2.4, "b": float("nan")}, {"a": (8, 6), "b": (6, 8)}, need=40)


@pytest.mark.parametrize("trainer,rates", [("recovery", dict(lr=1e-4, min_lr=1e-2)),
                                           ("truncation", dict(lr=1.0, min_lr=4.0))])  # lr lowered, Dobi's min_lr kept
def test_a_final_learning_rate_above_the_initial_one_is_refused_before_any_work(trainer, rates):
    model = model_for(trainer)
    before = state(model)
    loss = CountingLoss()
    with pytest.raises(FisherkronError, match=r"min_lr=\S+ \(the final learning rate\) exceeds lr=\S+ .*min_lr <= lr"):
        train(trainer, model, loss_fn=loss, **rates)
    assert loss.calls == 0
    assert_unchanged(model, before)


# ----------------------------------------------------------------------------- checkpoint folders

@pytest.fixture(scope="module")
def killed_write(tmp_path_factory):
    """The temporary that a checkpoint write killed by SIGKILL leaves: a real process, killed mid-write."""
    folder = tmp_path_factory.mktemp("killed")
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from pathlib import Path
        from fisherkron.hf.training import save_checkpoint

        def dying_save(obj, f):
            with open(f, "wb") as fh:
                fh.write(b"PK half a checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = dying_save
        save_checkpoint(Path(sys.argv[1]), {"step": 1})
    """)
    out = subprocess.run([sys.executable, "-c", script, str(folder / "run.pt")], env=child_env(),
                         capture_output=True, text=True, timeout=CHILD_SECONDS)
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = temporaries(folder)
    assert len(left) == 1 and not (folder / "run.pt").exists()
    return folder / left[0]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_temporary_of_a_killed_checkpoint_write_is_removed_by_the_next_run(trainer, killed_write, tmp_path):
    shutil.copy2(killed_write, tmp_path)
    live = tmp_path / f"{TMP}{os.getpid()}-other-x.pt"  # a write of a live process (this one) is left alone
    live.write_bytes(b"in progress")
    train(trainer, model_for(trainer), steps=1, checkpoint=tmp_path / "run.pt")
    assert temporaries(tmp_path) == [live.name]
    assert (tmp_path / "run.pt").exists()


def read_only(folder: Path):
    """Make ``folder`` unwritable (chmod; for root, which chmod does not stop, the immutable attribute)."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK) and not _blocked(folder):
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if not _blocked(folder):
        writable(folder)
        pytest.skip("cannot make a folder read-only here (root without chattr)")


def _blocked(folder: Path) -> bool:
    try:
        (folder / "probe").touch()
    except OSError:
        return True
    (folder / "probe").unlink()
    return False


def writable(folder: Path):
    if shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_an_unwritable_checkpoint_folder_is_refused_before_any_work(trainer, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    model = model_for(trainer)
    before = state(model)
    loss = CountingLoss()
    read_only(folder)
    try:
        with pytest.raises(FisherkronError, match=rf"cannot write checkpoints in \S*{folder.name} \(.*\); nothing was "
                                                  r"changed\. Make the folder writable"):
            train(trainer, model, loss_fn=loss, checkpoint=folder / "run.pt")
    finally:
        writable(folder)
    assert loss.calls == 0
    assert_unchanged(model, before)
    assert list(folder.iterdir()) == []


CTRL_C_THEN_SIGTERM = """
    import os, signal, sys, torch
    from tiny_models import tiny_llama, token_batches
    from fisherkron.hf.surgery import compress
    from fisherkron.hf.recovery import recover
    from fisherkron.hf.truncation import train_truncation

    real_save = torch.save

    def save(obj, f):  # SIGTERM arrives while the checkpoint of the interrupted run is being written
        os.kill(os.getpid(), signal.SIGTERM)
        real_save(obj, f)

    def ctrl_c(step, record):
        if step == 2:
            torch.save = save
            raise KeyboardInterrupt

    for trainer, ckpt in zip(("recovery", "truncation"), sys.argv[1:]):
        torch.save = real_save
        model = tiny_llama()
        try:
            if trainer == "recovery":
                compress(model, "svd", None, ratio=0.3)
                recover(model, token_batches(), steps=4, lr=5e-3, checkpoint=ckpt, checkpoint_every=100,
                        callback=ctrl_c)
            else:
                train_truncation(model, "svd", None, token_batches(), ratio=0.3, steps=4, checkpoint=ckpt,
                                 checkpoint_every=100, callback=ctrl_c)
        except KeyboardInterrupt:
            print("interrupted", trainer)
"""


def test_sigterm_during_the_checkpoint_write_of_a_ctrl_c_is_a_second_interruption(tmp_path):
    """The write completes, the signal then stops the run as Ctrl-C does, and the next run resumes from it
    (not a process killed by the SIGTERM with the write half done). One child process runs both trainers."""
    ckpts = {trainer: tmp_path / f"{trainer}.pt" for trainer in TRAINERS}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C_THEN_SIGTERM), *map(str, ckpts.values())],
                         env=child_env(), capture_output=True, text=True, timeout=CHILD_SECONDS)
    assert (out.returncode, out.stdout.split("\n")[:2]) == (0, [f"interrupted {t}" for t in TRAINERS]), \
        out.stderr[-2000:]
    assert temporaries(tmp_path) == []
    assert [torch.load(c, weights_only=True)["step"] for c in ckpts.values()] == [2, 2]
    recovered = train("recovery", compressed(), checkpoint=ckpts["recovery"], checkpoint_every=100)
    truncated = train_truncation(tiny_llama(), "svd", None, token_batches(), ratio=0.3, steps=4,
                                 checkpoint=ckpts["truncation"], checkpoint_every=100)
    assert [(r.resumed_at, r.steps) for r in (recovered, truncated)] == [(2, 4), (2, 4)]


# ----------------------------------------------------------------------------- what recovery trains

def test_recovery_on_a_basis_sharing_model_says_it_trains_low_rank_layers_only(tmp_path):
    model = tiny_llama()
    stats = collect_calibration(model, token_batches(), None, stats=("xxt",), cache_dir=tmp_path)
    compress_basis_sharing(model, stats, 0.2)
    before = state(model)
    shared = "model.layers.0.self_attn.q_proj"
    for layers in (None, [shared]):
        with pytest.raises(FisherkronError, match=r"^recovery trains low-rank factorised layers \(LowRankLinear.*"
                                                  r"are Basis Sharing layers \(SharedBasisLinear\), which it does "
                                                  r"not train$"):
            recover(model, token_batches(), steps=1, layers=layers)
    assert_unchanged(model, before)
