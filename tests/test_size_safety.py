"""A compression never makes a model larger than it was, on disk or in parameters, and never starts work that
cannot fit in memory.

Regression tests on tiny random Llama folders (tests/tiny_models.py):

1. the dtype: a bfloat16 folder is saved in bfloat16 (``--dtype auto``), the JSON line and the manifest say the
   dtype written, ``--dtype`` chooses another, and ``save_compressed(dtype=)`` is the API's twin;
2. factors that cannot fit: a layer whose Kronecker factors (``m^2 + n^2`` float64 entries, several copies) exceed
   the memory limit is refused by the plan, before any calibration and in ``--dry-run``, in one line naming the
   layer, its size in GB and the limit, or kept dense with ``--skip-large-layers``;
3. a tied ``lm_head`` (its weight is the embedding matrix) is left as it is with a sentence, refused when named,
   never untied; a plan whose model would be larger than the input is refused.
"""
import json
import struct

import pytest
import torch
from test_cli_robustness import _save
from tiny_models import token_batches, tiny_llama

import fisherkron.hf as api
import fisherkron.hf.budget as budget
import fisherkron.hf.calibration
from fisherkron.cli import main
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.hf.saving import MANIFEST, load_compressed, save_compressed
from fisherkron.hf.surgery import compress

#: a real run of the command on a tiny model: rank 2, two calibration batches of two 16-token sequences
FAST = ["--rank", "2", "--k", "2", "--batch-size", "2", "--seq-len", "16", "--no-cache"]
#: what one rank-2 lm_head of the tiny Llama's (97 x 24) factors need at least: 3 float64 copies of m^2 + n^2
LM_HEAD_BYTES = 3 * 8 * (97 ** 2 + 24 ** 2)


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"bf16": _save(tiny_llama().to(torch.bfloat16), root / "bf16"),
            "f32": _save(tiny_llama(), root / "f32"),
            "tied": _save(tiny_llama(tie_word_embeddings=True), root / "tied")}


def run(argv, capsys) -> tuple[int, str, list[str]]:
    """``(status, stdout, stderr lines without progress bars)`` of ``fisherkron argv``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, [ln for ln in cap.err.splitlines() if ln.strip() and "it/s" not in ln]


def _forbid_work(monkeypatch):
    """Fail the test if the command reads data or calibrates (the plan must refuse first)."""
    for name in ("c4_documents", "lm_batches", "collect_calibration", "compress", "save_compressed"):
        monkeypatch.setattr(api, name, lambda *a, _n=name, **k: pytest.fail(f"reached {_n}"))
    monkeypatch.setattr(fisherkron.hf.calibration, "collect_calibration",
                        lambda *a, **k: pytest.fail("reached collect_calibration"))


def _file_dtypes(folder) -> set[str]:
    """The safetensors dtypes (``"BF16"``, ``"F32"``, ...) of every tensor saved in ``folder``."""
    found = set()
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        found |= {spec["dtype"] for k, spec in header.items() if k != "__metadata__"}
    return found


def _weights_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# ----------------------------------------------------------------------------- 1. the dtype

def test_a_bfloat16_folder_is_saved_in_bfloat16_and_the_json_says_so(tmp_path, capsys, folders):
    out = tmp_path / "out"
    code, text, err = run(["-q", "compress", folders["bf16"], "--method", "svd", "--out", out, *FAST], capsys)
    assert code == 0, err
    summary = json.loads(text)
    assert summary["dtype"] == "bfloat16" and summary["input_dtype"] == "bfloat16"
    assert _file_dtypes(out) == {"BF16"}
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "bfloat16"
    assert _weights_bytes(out) < _weights_bytes(folders["bf16"])  # compressed: smaller than the input on disk
    assert summary["saved_bytes"] == sum(f.stat().st_size for f in out.iterdir() if f.name != MANIFEST)
    loaded = load_compressed(out)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert any(isinstance(m, LowRankLinear) for m in loaded.modules())

    # --dtype chooses; a wider one than the input's is said in one warning
    code, text, err = run(["compress", folders["bf16"], "--method", "svd", "--out", out, "--overwrite",
                           "--dtype", "float32", *FAST], capsys)
    assert code == 0 and json.loads(text.strip().splitlines()[-1])["dtype"] == "float32"
    assert _file_dtypes(out) == {"F32"}
    assert [ln for ln in err if "WARNING" in ln and "float32" in ln and "bfloat16" in ln], err
    # the plan says it too
    code, text, _ = run(["-q", "compress", folders["f32"], "--rank", "2", "--dry-run"], capsys)
    assert code == 0 and json.loads(text)["dtype"] == "float32"


def test_save_compressed_writes_the_dtype_asked_and_leaves_the_model_as_it_is(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    compress(model, "svd", None, rank=2)
    out = save_compressed(model, tmp_path / "bf16", dtype="bfloat16")
    assert _file_dtypes(out) == {"BF16"} and json.loads((out / MANIFEST).read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the model was not cast
    loaded = load_compressed(out)
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    merged = save_compressed(model, tmp_path / "merged", dtype=torch.float16, merged=True)
    assert _file_dtypes(merged) == {"F16"}
    # a value float16 cannot hold is refused, not written as inf
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.second.weight[0, 0] = 1e6
    with pytest.raises(FisherkronError, match="beyond what float16 can hold") as err:
        save_compressed(model, tmp_path / "f16", dtype="float16")
    assert "\n" not in str(err.value) and not (tmp_path / "f16").exists()
    with pytest.raises(FisherkronError, match="cannot be saved"):
        save_compressed(model, tmp_path / "int", dtype="int8")


# ----------------------------------------------------------------------------- 2. factors that cannot fit

def test_a_layer_whose_factors_cannot_fit_is_refused_by_the_plan(tmp_path, monkeypatch, capsys, folders):
    _forbid_work(monkeypatch)
    limit_gb = 200_000 / 1e9  # above every block layer's factors, below lm_head's (LM_HEAD_BYTES)
    for extra in (["--dry-run"], ["--out", tmp_path / "out"]):
        code, _, err = run(["compress", folders["f32"], "--layers", "*", "--method", "gfwsvd", "--rank", "2",
                            "--factor-memory-gb", limit_gb, *extra], capsys)
        assert code == 2 and len(err) == 1, err
        assert "lm_head" in err[0] and "GB" in err[0] and "0.0002 GB" in err[0] and "--skip-large-layers" in err[0]
    assert not (tmp_path / "out").exists()
    # the default limit is the memory available now
    monkeypatch.setattr(budget, "available_memory", lambda: 200_000)
    code, _, err = run(["compress", folders["f32"], "--layers", "*", "--method", "kfac_svd", "--rank", "2",
                        "--dry-run"], capsys)
    assert code == 2 and len(err) == 1 and "lm_head" in err[0] and "available" in err[0], err
    # a method whose weights are vectors needs no factors: nothing to refuse
    code, text, _ = run(["-q", "compress", folders["f32"], "--layers", "*", "--method", "fwsvd", "--rank", "2",
                         "--dry-run"], capsys)
    assert code == 0 and "lm_head" in json.loads(text)["ranks"]


def test_skip_large_layers_keeps_them_dense(tmp_path, monkeypatch, capsys, folders):
    monkeypatch.setattr(budget, "available_memory", lambda: 200_000)
    code, text, err = run(["compress", folders["f32"], "--layers", "*", "--method", "gfwsvd", "--rank", "2",
                           "--dry-run", "--skip-large-layers"], capsys)
    plan = json.loads(text.strip().splitlines()[-1])
    assert code == 0 and "lm_head" not in plan["ranks"] and len(plan["ranks"]) == 14
    assert [ln for ln in err if "WARNING" in ln and "lm_head" in ln and "kept dense" in ln], err
    # a real run: the other layers are calibrated and factorised, lm_head stays dense
    out = tmp_path / "out"
    code, text, err = run(["-q", "compress", folders["f32"], "--layers", "*", "--method", "gfwsvd", "--out", out,
                           "--skip-large-layers", *FAST], capsys)
    assert code == 0, err
    loaded = load_compressed(out)
    assert isinstance(loaded.lm_head, torch.nn.Linear) and isinstance(loaded.model.layers[0].mlp.up_proj,
                                                                      LowRankLinear)


def test_compress_refuses_large_factors_before_any_factorisation(tmp_path, monkeypatch):
    model = tiny_llama()
    stats = fisherkron.hf.calibration.collect_calibration(model, token_batches(k=2), "*", methods=("kfac_svd",),
                                                         cache=False, cache_dir=tmp_path)
    assert budget.factor_bytes(97, 24, "kfac_svd") == LM_HEAD_BYTES
    with pytest.raises(FisherkronError, match=r"layer lm_head \(97 x 24\) needs at least 0.00024 GB"):
        compress(model, "kfac_svd", stats, "*", rank=2, factor_memory_limit=200_000)
    assert not any(isinstance(m, LowRankLinear) for m in model.modules())
    rep = compress(model, "kfac_svd", stats, "*", rank=2, factor_memory_limit=200_000, skip_large_layers=True)
    assert "lm_head" not in rep.layers and isinstance(model.lm_head, torch.nn.Linear) and len(rep.layers) == 14


# ----------------------------------------------------------------------------- 3. tied weights, growth

def test_a_tied_lm_head_is_left_tied_and_the_model_gets_smaller(tmp_path, capsys, folders):
    out = tmp_path / "out"
    code, text, err = run(["compress", folders["tied"], "--layers", "*", "--method", "svd", "--out", out, *FAST],
                          capsys)
    assert code == 0, err
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["ratio"] > 0 and summary["params_after"] < summary["params_before"]
    assert [ln for ln in err if "lm_head" in ln and "tied" in ln], err
    loaded = load_compressed(out)
    assert isinstance(loaded.lm_head, torch.nn.Linear)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # the plan says the same, and a tied layer named explicitly is refused
    code, text, _ = run(["-q", "compress", folders["tied"], "--layers", "*", "--rank", "2", "--dry-run"], capsys)
    plan = json.loads(text)
    assert code == 0 and "lm_head" not in plan["ranks"] and plan["params_after"] < plan["params_before"]
    code, _, err = run(["compress", folders["tied"], "--layers", "lm_head", "--rank", "2", "--dry-run"], capsys)
    assert code == 2 and len(err) == 1 and "shares its weight with model.embed_tokens.weight" in err[0], err


def test_a_plan_that_would_make_the_model_larger_is_refused(monkeypatch, capsys, folders):
    """The last guard, should a shared weight go unseen: the exact count after the plan exceeds the one before."""
    monkeypatch.setattr(budget, "shared_weights", lambda model, names: {})
    code, _, err = run(["compress", folders["tied"], "--layers", "lm_*", "--rank", "2", "--dry-run"], capsys)
    assert code == 2 and len(err) == 1 and "would make the model larger" in err[0], err
    model = tiny_llama(tie_word_embeddings=True)
    with pytest.raises(FisherkronError, match="more than the model's"):
        compress(model, "svd", None, "lm_head", rank=2)
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_compress_leaves_a_tied_lm_head_alone(caplog):
    model = tiny_llama(tie_word_embeddings=True)
    with caplog.at_level("WARNING", logger="fisherkron"):
        rep = compress(model, "svd", None, "*", rank=2)
    assert "lm_head" not in rep.layers and rep.ratio > 0 and "tied" in caplog.text
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(FisherkronError, match="shares its weight"):
        compress(tiny_llama(tie_word_embeddings=True), "svd", None, "lm_head", rank=2)
    assert budget.params_after(model, {}) == budget.count_params(model)
