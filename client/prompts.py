"""Benchmark prompts: code snippets cut from files the tiny models never trained on."""
from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "models" / "prompts.jsonl"
HELD_OUT_EVERY = 25   # the tiny-model trainer holds out files with index % 25 == 24


def load_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """One JSON string per line; `n` cycles through the file if it holds fewer."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found (make it with "
                                f"`python -m client.prompts --out {path}`)")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        value = json.loads(line)
        if not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON string")
        prompts.append(value)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    if n is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(n)]


def make_heldout_prompts(count: int = 256, seed: int = 0, min_lines: int = 3,
                         max_lines: int = 12) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idle_test", "site-packages")
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not any(part in skip for part in p.relative_to(stdlib).parts))
    held_out = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        lines = rng.choice(held_out).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < max_lines + 1:
            continue
        start = rng.randrange(0, len(lines) - max_lines)
        snippet = "".join(lines[start:start + rng.randint(min_lines, max_lines)])
        if snippet.strip() and len(snippet) < 600:
            prompts.append(snippet)
    return prompts


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("".join(json.dumps(p) + "\n" for p in make_heldout_prompts(a.count, a.seed)))
    print(f"wrote {a.count} prompts to {a.out}")
