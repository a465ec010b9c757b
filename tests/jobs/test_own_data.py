"""docs/training.md's "Your own data on a laptop" recipe, run as written: its Python snippet makes a
JSON-lines corpus and trains a `tokenizers` BPE saved as one JSON file, then `examples/train.py`
trains `configs/cpu-own-data.yaml` on them for a few steps, started from another working
directory (the config's relative paths are relative to its folder; the overrides' to the working
directory), and ends without torch's process-group teardown warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe_snippet() -> str:
    """The Python the recipe pipes into `python -` (between `<<'EOF'` and `EOF`)."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("### Your own data on a laptop") :]
    start = section.index("python - <<'EOF'\n") + len("python - <<'EOF'\n")
    return section[start : section.index("\nEOF\n", start)]


def test_the_readme_recipe_trains_on_its_jsonl_and_bpe_from_any_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "cpu-own-data.yaml", tmp_path / "configs")
    (tmp_path / "data" / "own").mkdir(parents=True)  # the recipe's `mkdir -p data/own`
    subprocess.run([sys.executable, "-c", recipe_snippet()], cwd=tmp_path, check=True, timeout=300)
    tok = Tokenizer.from_file(str(tmp_path / "data" / "own" / "tok.json"))
    assert tok.get_vocab_size() == 4096 and tok.token_to_id("<|endoftext|>") is not None

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            "--config",
            str(tmp_path / "configs" / "cpu-own-data.yaml"),
            "training.steps=3",
            "checkpoint.dir=ckpt",  # an override: relative to the working directory
        ],
        cwd=elsewhere,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "No backend of type" not in res.stderr + res.stdout
    docs = len((tmp_path / "data" / "own" / "corpus.jsonl").read_text().splitlines())
    assert f"data: {docs} documents in 1 jsonl files" in res.stderr  # the corpus next to the config
    assert "trained steps 0..3" in res.stdout
    first, last = (float(x) for x in res.stdout.split("loss ", 1)[1].split("\n", 1)[0].split(" -> "))
    assert last < first
    assert (elsewhere / "ckpt" / "step-00000003").is_dir()
    assert (elsewhere / ".oobleck-cache" / "tokens").is_dir() and (elsewhere / "runs" / "cpu-own-data").is_dir()
