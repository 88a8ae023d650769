"""Record native llama-speculative-simple's per-step acceptance for the parity test.

    python scripts/build_native.sh && python scripts/record_native_acceptance.py
writes tests/data/native_acceptance.json (used when no native build is at hand).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import native  # noqa: E402
from conftest import PROMPTS  # noqa: E402
from test_parity import K, N, rendered_prompts  # noqa: E402

from specli import defaults  # noqa: E402


def main() -> None:
    bin_dir = native.native_bin_dir()
    if bin_dir is None:
        sys.exit("no native build: run scripts/build_native.sh first")
    draft = defaults.smollm2_q4_1()
    target = defaults.derived("f16", draft)
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(rendered_prompts()):
            f = Path(tmp) / f"p{i}.txt"
            f.write_text(text + "\n")
            steps[PROMPTS[i]] = native.speculative_simple(bin_dir, target, draft, str(f), N, K,
                                                          steps=True).steps
    doc = {"llama_cpp_python": importlib.metadata.version("llama-cpp-python"), "k": K, "n": N,
           "target": Path(target).name, "steps": steps}
    (ROOT / "tests" / "data" / "native_acceptance.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
